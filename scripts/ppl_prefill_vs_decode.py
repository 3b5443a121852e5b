"""Perplexity of the first N tokens of a text with each KV dtype, once as one prefill (every page written whole)
and once token by token (every page written a token at a time, as decode writes it): per-page formats (int4ch)
re-quantize a page's earlier tokens when a channel's range widens, so the two differ for them.

--key-error: instead, the relative error of the keys each format stores (the model's fp32 keys written into a
pool of the format whole or a token at a time, read back), a measure free of the noise a changed rounding
spreads through later layers.

    python scripts/ppl_prefill_vs_decode.py --text tests/data/apache-2.0.txt fp32 int4ch/int4 int8/int4 int4
    python scripts/ppl_prefill_vs_decode.py --key-error --tokens 512 --text tests/data/apache-2.0.txt int4ch/int4
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from localpd.kernels.kv_dispatch import gather_kv, write_kv_ref
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
    p.add_argument("--key-error", action="store_true", help="the stored keys' relative error, not perplexity")
    args = p.parse_args()
    loaded = load_model(resolve_model(args.model, pull=False).path, scheme="fp32")
    ids = loaded.tokenizer().encode(Path(args.text).read_text())[:args.tokens]
    model = Transformer(loaded.config, dict(loaded.weights))
    c, n_pages = model.config, -(-len(ids) // PAGE_SIZE)
    if args.key_error:
        return key_error(model, ids, args.kv)
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


def key_error(model: Transformer, ids: list[int], kv_dtypes: list[str]) -> int:
    c, T = model.config, len(ids)
    n_pages = -(-T // PAGE_SIZE)
    pages, slots = torch.arange(n_pages), torch.arange(T)
    exact = new_kv_pool("fp32", c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    model.forward(Batch.single(ids, 0, n_pages, PAGE_SIZE, "cpu"), exact)
    kvs = [gather_kv(exact.layer(i), pages, T, torch.float32) for i in range(c.n_layers)]
    print("| KV dtype | keys written whole | a token at a time |\n| --- | --- | --- |")
    for kv in kv_dtypes:
        row = []
        for chunks in ([(0, T)], [(t, t + 1) for t in range(T)]):
            err = ref = 0.0
            pool = new_kv_pool(kv, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
            for i, (k, v) in enumerate(kvs):
                for t0, t1 in chunks:
                    write_kv_ref(pool.layer(i), k[t0:t1], v[t0:t1], slots[t0:t1])
                err += ((gather_kv(pool.layer(i), pages, T, torch.float32)[0] - k) ** 2).sum().item()
                ref += (k ** 2).sum().item()
            row.append(f"{err / ref:.3e}")
        print(f"| {kv} | {row[0]} | {row[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
