import glob
import os
from pathlib import Path

import pytest
import torch

from localpd.model.transformer import Batch, Transformer
from localpd.quant.kv import new_kv_pool, same_kv

PAGE = 16


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    """llama.cpp's CPU tools (llama-perplexity, llama-server): $LOCALPD_LLAMA_BIN, or what
    ../shared/peers/llama-cpp.sh built under ~/.cache/localpd-peers. Building them takes about 8 minutes on 2 cores,
    more than CI's run has to spare beside the suite, so the tests that need them skip where they are absent."""
    found = [os.environ.get("LOCALPD_LLAMA_BIN", "")]
    found += sorted(glob.glob(os.path.expanduser("~/.cache/localpd-peers/llama.cpp-*/build/bin")), reverse=True)
    for d in found:
        if d and all(os.access(Path(d) / tool, os.X_OK) for tool in ("llama-perplexity", "llama-server")):
            return Path(d)
    pytest.skip("llama.cpp's llama-perplexity and llama-server are not built on this machine "
                "(bash ../shared/peers/llama-cpp.sh builds them, about 8 minutes on 2 cores; or set LOCALPD_LLAMA_BIN)")


@pytest.fixture
def greedy():
    return greedy_tokens


def greedy_tokens(model: Transformer, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """localpd's greedy tokens after ids (up to n, stopping at eos, which is left out), one step at a time."""
    pages = -(-(len(ids) + n) // PAGE)
    c = model.config
    kv = new_kv_pool(same_kv(model.dtype), c.n_layers, pages, PAGE, c.n_kv_heads, c.head_dim, model.dtype,
                     model.device)
    out, step, start = [], ids, 0
    while len(out) < n:
        logits = model.forward(Batch.single(step, start, pages, PAGE, model.device), kv)
        token = int(torch.argmax(logits[-1]))
        if token in eos:
            break
        out.append(token)
        start, step = start + len(step), [token]
    return out
