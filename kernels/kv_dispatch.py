"""Writing keys and values into KV pages and attending over them: the torch references, which the CPU runs.

paged_attention serves every kind of step: query rows are B sequences concatenated (q_starts), sequence b's
keys are positions 0 .. seq_lens[b] - 1 (its new tokens' included, written first), and query row j of a
sequence with q_len rows sits at position seq_lens[b] - q_len + j and attends causally up to it. Decode is
q_len = 1; a prefill chunk after a cached prefix is q_len > 1; a step may mix both. GQA: query head h reads
kv head h // (Hq // H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localpd.quant.kv import KVLayer, dequantize_kv, quantize_kv


def _pick(t, pages, offs):
    return None if t is None else t[pages, offs]


def write_kv_ref(layer: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, H, D] into the slots (page * page_size + offset) [T], quantized to the layer's format."""
    pages, offs = slots // layer.page_size, slots % layer.page_size
    for x, data, scale, zero in ((k, layer.k, layer.k_scale, layer.k_zero), (v, layer.v, layer.v_scale, layer.v_zero)):
        q, s, z = quantize_kv(x, layer.kv_dtype)
        data[pages, offs] = q
        if s is not None:
            scale[pages, offs] = s
        if z is not None:
            zero[pages, offs] = z


def gather_kv(layer: KVLayer, pages: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n positions of a sequence whose pages are `pages`, dequantized: K, V [n, H, D]."""

    def one(data, scale, zero):
        d = data[pages].flatten(0, 1)[:n]
        s = None if scale is None else scale[pages].flatten(0, 1)[:n]
        z = None if zero is None else zero[pages].flatten(0, 1)[:n]
        return dequantize_kv(d, s, z, layer.kv_dtype, dtype)

    return one(layer.k, layer.k_scale, layer.k_zero), one(layer.v, layer.v_scale, layer.v_zero)


def paged_attention_ref(q: torch.Tensor, layer: KVLayer, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_starts: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; softmax in float32 for half-precision inputs (SDPA's own)."""
    out = torch.empty_like(q)
    ps = layer.page_size
    lens, starts = seq_lens.tolist(), q_starts.tolist()
    for b, n in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        t = e - s
        k, v = gather_kv(layer, page_table[b, :-(-n // ps)].long(), n, q.dtype)
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1)
    return out


def write_kv(layer: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    write_kv_ref(layer, k, v, slots)


def paged_attention(q: torch.Tensor, layer: KVLayer, page_table: torch.Tensor, seq_lens: torch.Tensor,
                    q_starts: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_attention_ref(q, layer, page_table, seq_lens, q_starts, scale)
