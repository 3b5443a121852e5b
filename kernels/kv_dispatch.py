"""Writing keys/values into KV pages and attending over them: torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localpd.quant.kv import KVLayer


def write_kv(layer: KVLayer, k, v, slots) -> None:
    ps = layer.page_size
    pages, offs = slots // ps, slots % ps
    layer.k[pages, offs] = k.to(layer.k.dtype)
    layer.v[pages, offs] = v.to(layer.v.dtype)


def paged_attention(q, layer: KVLayer, page_table, seq_lens, q_starts, scale: float):
    out = torch.empty_like(q)
    ps = layer.page_size
    for b in range(seq_lens.shape[0]):
        n, s, e = int(seq_lens[b]), int(q_starts[b]), int(q_starts[b + 1])
        pages = page_table[b, :-(-n // ps)].long()
        k = layer.k[pages].flatten(0, 1)[:n].to(q.dtype)
        v = layer.v[pages].flatten(0, 1)[:n].to(q.dtype)
        t = e - s
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1)
    return out
