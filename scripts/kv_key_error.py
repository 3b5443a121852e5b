"""Relative error of the keys a KV format stores, for pages written whole (prefill) and a token at a time
(decode): the model's fp32 keys for the first N tokens of a text, written into a pool of each format, read back.
Per-page formats (int4ch) re-quantize a page's earlier tokens when a channel's range widens, so their two columns
differ; per-token formats store the same codes either way.

    python scripts/kv_key_error.py --text tests/data/apache-2.0.txt int4ch/int4 int8/int4 int4
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    loaded = load_model(resolve_model(args.model, pull=False).path, scheme="fp32")
    ids = loaded.tokenizer().encode(Path(args.text).read_text())[:args.tokens]
    model = Transformer(loaded.config, dict(loaded.weights))
    c, T = model.config, len(ids)
    n_pages, pages = -(-T // PAGE_SIZE), torch.arange(-(-T // PAGE_SIZE))
    exact = new_kv_pool("fp32", c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    model.forward(Batch.single(ids, 0, n_pages, PAGE_SIZE, "cpu"), exact)
    keys = [gather_kv(exact.layer(i), pages, T, torch.float32) for i in range(c.n_layers)]
    slots = torch.arange(T)
    print("| KV dtype | keys written whole | a token at a time |\n| --- | --- | --- |")
    for kv in args.kv:
        row = []
        for whole in (True, False):
            err = ref = 0.0
            pool = new_kv_pool(kv, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
            for i, (k, v) in enumerate(keys):
                layer = pool.layer(i)
                for t0, t1 in [(0, T)] if whole else [(t, t + 1) for t in range(T)]:
                    write_kv_ref(layer, k[t0:t1], v[t0:t1], slots[t0:t1])
                got = gather_kv(layer, pages, T, torch.float32)[0]
                err += ((got - k) ** 2).sum().item()
                ref += (k ** 2).sum().item()
            row.append(f"{err / ref:.3e}")
        print(f"| {kv} | {row[0]} | {row[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
