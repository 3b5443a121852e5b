import glob
import os
from pathlib import Path

import pytest
import torch

from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool, same_kv

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


@pytest.fixture
def greedy_path():
    return greedy_with_margins


def greedy_tokens(model: Transformer, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """localpd's greedy tokens after ids (up to n, stopping at eos, which is left out), one step at a time."""
    return greedy_with_margins(model, ids, n, eos)[0]


def greedy_with_margins(model: Transformer, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], list[float]]:
    """localpd's greedy tokens after ids (up to n, stopping at eos, which is left out) and, at every step (the one
    that chose eos too), the margin in log-probability between its two likeliest tokens: a step whose margin is
    small is a near-tie, which another engine's arithmetic may tip either way."""
    pages = -(-(len(ids) + n + 1) // PAGE)
    c = model.config
    kv = new_kv_pool(same_kv(model.dtype), c.n_layers, pages, PAGE, c.n_kv_heads, c.head_dim, model.dtype,
                     model.device)
    out, margins, step, start = [], [], ids, 0
    while len(out) < n:
        logits = model.forward(Batch.single(step, start, pages, PAGE, model.device), kv)
        top = torch.topk(torch.log_softmax(logits[-1].double(), -1), 2)
        margins.append(float(top.values[0] - top.values[1]))
        token = int(top.indices[0])
        if token in eos:
            break
        out.append(token)
        start, step = start + len(step), [token]
    return out, margins
