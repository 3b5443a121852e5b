"""Perplexity of the first N tokens of a text with each KV dtype, once as one prefill (every page written whole)
and once token by token (every page written a token at a time, as decode writes it): per-page formats (int4ch)
re-quantize a page on every write, so the two differ for them.

    python scripts/ppl_prefill_vs_decode.py --text tests/data/apache-2.0.txt fp32 int4ch/int4 int8/int4 int4
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from localpd.loader import load_model
from localpd.model import Batch, Transformer
from localpd.quant.kv import new_kv_pool
from localpd.registry import resolve_model

PAGE_SIZE = 16


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kv", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    loaded = load_model(resolve_model(args.model, pull=False).path, scheme="fp32")
    ids = loaded.tokenizer().encode(Path(args.text).read_text())[:args.tokens]
    model = Transformer(loaded.config, dict(loaded.weights))
    c, n_pages = model.config, -(-len(ids) // PAGE_SIZE)
    target = torch.tensor(ids[1:])
    for kv in args.kv:
        for mode in ("prefill", "decode"):
            pool = new_kv_pool(kv, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, model.dtype, "cpu")
            if mode == "prefill":
                logits = model.forward(Batch.single(ids, 0, n_pages, PAGE_SIZE, "cpu", all_logits=True), pool)
            else:
                logits = torch.cat([model.forward(Batch.single([t], i, n_pages, PAGE_SIZE, "cpu"), pool)
                                    for i, t in enumerate(ids)])
            nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target).item()
            print(f"{kv:12} {mode:8} {math.exp(nll):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
