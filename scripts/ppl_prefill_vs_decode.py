"""Perplexity of the first N tokens of a text with each KV dtype, once as one prefill (every page written whole)
and once token by token (every page written a token at a time, as decode writes it), with the stage (as the
engine runs) and without it: per-page formats (int4ch) re-quantize a page's earlier tokens when a channel's range
widens; from the staged tokens as computed that gives the page a prefill writes, from the page's own codes it
rounds them twice.

--key-error: instead, the relative error of the keys each format stores (the model's fp32 keys written into a
pool of the format whole or a token at a time, read back), as finally stored and as each position attends to
them, and the attention output each position's fp32 query gets from them: measures free of the noise a changed
rounding spreads through later layers.

    python scripts/ppl_prefill_vs_decode.py --text tests/data/apache-2.0.txt fp32 int4ch/int4 int8/int4 int4
    python scripts/ppl_prefill_vs_decode.py --modes prefill --text localpd/quantize/calibration.txt fp32
    python scripts/ppl_prefill_vs_decode.py --key-error --tokens 512 --text tests/data/apache-2.0.txt int4ch/int4
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch

import localpd.model.transformer as model_module
from localpd.kvcache.dispatch import gather_kv, write_kv_ref
from localpd.load.loader import load_model
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool
from localpd.load.registry import resolve_model

PAGE_SIZE = 16


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kv", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--modes", default="prefill,decode,decode-unstaged", help="some of the default, comma-separated")
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
        for mode in args.modes.split(","):
            pool = new_kv_pool(kv, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, model.dtype, "cpu")
            if mode == "prefill":
                logits = model.forward(Batch.single(ids, 0, n_pages, PAGE_SIZE, "cpu", all_logits=True), pool)
            else:
                steps = [Batch.single([t], i, n_pages, PAGE_SIZE, "cpu") for i, t in enumerate(ids)]
                if mode == "decode-unstaged":
                    steps = [replace(b, stage_slots=None) for b in steps]
                logits = torch.cat([model.forward(b, pool) for b in steps])
            nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target).item()
            print(f"{kv:12} {mode:16} {math.exp(nll):.4f}", flush=True)
    return 0


def key_error(model: Transformer, ids: list[int], kv_dtypes: list[str]) -> int:
    """Three tables, relative squared errors against the fp32 run: the keys as finally stored; the keys as
    attended (position t sees keys 0..t as they are stored right after t's write; summed over t); and, as
    attended, the attention output of each position's fp32 query (every 4th position), values' error included."""
    c, T = model.config, len(ids)
    n_pages = -(-T // PAGE_SIZE)
    pages, slots = torch.arange(n_pages), torch.arange(T)
    exact = new_kv_pool("fp32", c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    queries, original = [], model_module.rope_write_kv

    def write(*args):  # the model's own write, recording each layer's rotated queries
        q = original(*args)
        queries.append(q.clone())
        return q

    model_module.rope_write_kv = write
    try:
        model.forward(Batch.single(ids, 0, n_pages, PAGE_SIZE, "cpu"), exact)
    finally:
        model_module.rope_write_kv = original
    kvs = [gather_kv(exact.layer(i), pages, T, torch.float32) for i in range(c.n_layers)]
    modes = {"written whole": ([(0, T)], True), "a token at a time": ([(t, t + 1) for t in range(T)], True),
             "a token at a time, no stage": ([(t, t + 1) for t in range(T)], False)}
    rows = {}
    for kv in kv_dtypes:
        rows[kv] = []
        for chunks, staged in modes.values():
            sums = torch.zeros(6, dtype=torch.float64)  # error and reference of each table
            pool = new_kv_pool(kv, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
            for i, (k, v) in enumerate(kvs):
                layer, err = pool.layer(i), torch.zeros(T)
                square = (k ** 2).sum((1, 2))
                for t0, t1 in chunks:
                    stage_slots = slots[t0:t1] % PAGE_SIZE if staged else None  # stage row 0
                    write_kv_ref(layer, k[t0:t1], v[t0:t1], slots[t0:t1], stage_slots)
                    p0, p1 = t0 // PAGE_SIZE, -(-t1 // PAGE_SIZE)  # the pages this write touched
                    stored = gather_kv(layer, pages[p0:p1], t1 - p0 * PAGE_SIZE, torch.float32)[0]
                    err[p0 * PAGE_SIZE:t1] = ((stored - k[p0 * PAGE_SIZE:t1]) ** 2).sum((1, 2))
                    sums[2] += err.cumsum(0)[t0:t1].sum().item()
                    sums[3] += square.cumsum(0)[t0:t1].sum().item()
                    for t in range(-(-t0 // 4) * 4, t1, 4):
                        got = _attend(queries[i][t], *gather_kv(layer, pages, t + 1, torch.float32))
                        want = _attend(queries[i][t], k[:t + 1], v[:t + 1])
                        sums[4] += ((got - want) ** 2).sum().item()
                        sums[5] += (want ** 2).sum().item()
                sums[0] += err.sum().item()
                sums[1] += square.sum().item()
            rows[kv].append(sums[0::2] / sums[1::2])
    for title, which in (("keys as finally stored", 0), ("keys as attended", 1), ("attention output", 2)):
        print(f"\n{title}\n| KV dtype | {' | '.join(modes)} |\n| --- |{' --- |' * len(modes)}")
        for kv, row in rows.items():
            print(f"| {kv} | {' | '.join(f'{r[which]:.3e}' for r in row)} |", flush=True)
    return 0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query position's heads q [Hq, D] over keys and values [n, H, D] (GQA)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    weights = (torch.einsum("hd,nhd->hn", q, k) * q.shape[-1] ** -0.5).softmax(-1)
    return torch.einsum("hn,nhd->hd", weights, v)


if __name__ == "__main__":
    raise SystemExit(main())
