"""Triton kernels over the paged KV cache: writing keys/values (quantizing on the way in) and attention.

KIND selects the page format (quant/kv.py): 0 float (fp32/fp16/bf16), 1 int8, 2 fp8 e4m3, 3 int4 (groups of 32,
two values a byte). Packed values are read directly and dequantized in registers, so quantized KV moves fewer
bytes. Decode (every sequence one query) splits each sequence's pages over several programs (flash-decoding)
and a reduce kernel merges their partial softmaxes; prefill chunks tile queries by BLOCK_M and walk the key
pages with an online softmax and a causal mask. All query heads that share a KV head are one program (GQA):
its keys and values are loaded once for the group.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLOAT, INT8, FP8, INT4 = 0, 1, 2, 3


@triton.jit
def _load_page(data, scale, zero, page, tok, head, s_page, s_tok, s_head, c_page, c_tok, c_head,
               KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr):
    """One page of one KV head, dequantized to float32: [PS, D]."""
    t = tl.arange(0, PS)
    # no early return: Triton would still compile the code after a returning constexpr branch
    if KIND == 3:  # per element: its byte (d // 2), its nibble (d % 2) and its group's scale and zero (d // 32)
        d = tl.arange(0, D)
        p = tl.load(data + page * s_page + t[:, None] * s_tok + head * s_head + (d // 2)[None, :]).to(tl.int32)
        q = ((p >> ((d % 2) * 4)[None, :]) & 15).to(tl.float32)
        off = page * c_page + t[:, None] * c_tok + head * c_head + (d // 32)[None, :]
        x = q * tl.load(scale + off).to(tl.float32) + tl.load(zero + off).to(tl.float32)
    else:
        d = tl.arange(0, D)
        x = tl.load(data + page * s_page + t[:, None] * s_tok + head * s_head + d[None, :]).to(tl.float32)
        if KIND == 1 or KIND == 2:
            s = tl.load(scale + page * c_page + t * c_tok + head * c_head).to(tl.float32)
            x = x * s[:, None]
    return x


@triton.jit
def _rint(y):
    """Round half to even, as torch.round does (libdevice's rint is not available in the interpreter)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2 * tl.floor(r * 0.5)) != 0
    return tl.where(((r - y) == 0.5) & odd, r - 1, r)


@triton.jit
def write_kv_kernel(src, slots, data, scale, zero, s_src_t, s_src_h, s_page, s_tok, s_head, c_page, c_tok, c_head,
                    KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr):
    """One program per (token, head): quantize x[D] into its slot."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t)
    page, off = slot // PS, slot % PS
    base = data + page * s_page + off * s_tok + h * s_head
    cbase = page * c_page + off * c_tok + h * c_head
    if KIND == 3:
        g = tl.arange(0, D // 32)
        j = tl.arange(0, 16)
        idx = g[:, None] * 32 + 2 * j[None, :]  # [G, 16]: the even element of each byte
        lo = tl.load(src + t * s_src_t + h * s_src_h + idx).to(tl.float32)
        hi = tl.load(src + t * s_src_t + h * s_src_h + idx + 1).to(tl.float32)
        mn = tl.minimum(tl.min(lo, axis=1), tl.min(hi, axis=1))
        mx = tl.maximum(tl.max(lo, axis=1), tl.max(hi, axis=1))
        sc = ((mx - mn) / 15).to(tl.float16)
        zr = mn.to(tl.float16)
        sf = sc.to(tl.float32)
        safe = tl.where(sf > 0, sf, 1.0)
        qlo = tl.clamp(_rint((lo - zr.to(tl.float32)[:, None]) / safe[:, None]), 0, 15)
        qhi = tl.clamp(_rint((hi - zr.to(tl.float32)[:, None]) / safe[:, None]), 0, 15)
        packed = (qlo.to(tl.int32) | (qhi.to(tl.int32) << 4)).to(tl.uint8)
        tl.store(base + g[:, None] * 16 + j[None, :], packed)
        tl.store(scale + cbase + g, sc)
        tl.store(zero + cbase + g, zr)
    elif KIND == 0:
        d = tl.arange(0, D)
        tl.store(base + d, tl.load(src + t * s_src_t + h * s_src_h + d).to(data.dtype.element_ty))
    else:
        d = tl.arange(0, D)
        x = tl.load(src + t * s_src_t + h * s_src_h + d).to(tl.float32)
        top = 127.0 if KIND == 1 else 448.0
        sc = (tl.max(tl.abs(x), axis=0) / top).to(tl.float16)
        sf = sc.to(tl.float32)
        y = x / tl.where(sf > 0, sf, 1.0)
        if KIND == 1:
            tl.store(base + d, tl.clamp(_rint(y), -127, 127).to(tl.int8))
        else:
            tl.store(base + d, tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv))
        tl.store(scale + cbase, sc)


@triton.jit
def decode_kernel(q, k, v, k_scale, v_scale, k_zero, v_zero, page_table, seq_lens, part_acc, part_ml, sm_scale,
                  s_q_t, s_q_h, s_pt_b, s_page, s_tok, s_head, c_page, c_tok, c_head, pages_per_split,
                  KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                  SPLITS: tl.constexpr):
    """Program (b, kv head, split): the group's queries against this split's pages; partial results out."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(seq_lens + b)
    n_pages = tl.cdiv(n, PS)
    first = sp * pages_per_split
    last = tl.minimum(first + pages_per_split, n_pages)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < GROUP
    qv = tl.load(q + b * s_q_t + (kh * GROUP + g)[:, None] * s_q_h + d[None, :], mask=gmask[:, None], other=0.0)
    qv = qv.to(tl.float32) * sm_scale
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    t = tl.arange(0, PS)
    for p in range(first, last):
        page = tl.load(page_table + b * s_pt_b + p).to(tl.int64)
        kt = _load_page(k, k_scale, k_zero, page, 0, kh, s_page, s_tok, s_head, c_page, c_tok, c_head, KIND, PS, D)
        s = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2)  # [GP, PS]
        s = tl.where((p * PS + t)[None, :] < n, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        w = tl.exp(s - m_new[:, None])
        vt = _load_page(v, v_scale, v_zero, page, 0, kh, s_page, s_tok, s_head, c_page, c_tok, c_head, KIND, PS, D)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * vt[None, :, :], axis=1)
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
    row = (b * tl.num_programs(1) + kh) * SPLITS + sp
    tl.store(part_acc + (row * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(part_ml + (row * GP + g) * 2, m)
    tl.store(part_ml + (row * GP + g) * 2 + 1, l)


@triton.jit
def decode_reduce_kernel(part_acc, part_ml, out, s_o_t, s_o_h, D: tl.constexpr, GROUP: tl.constexpr,
                         GP: tl.constexpr, SPLITS: tl.constexpr):
    """Program (b, kv head): merge the splits' partial softmaxes into the output rows of the group."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    base = (b * tl.num_programs(1) + kh) * SPLITS
    m = tl.full((GP,), float("-inf"), tl.float32)
    for sp in range(SPLITS):
        m = tl.maximum(m, tl.load(part_ml + ((base + sp) * GP + g) * 2))
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for sp in range(SPLITS):
        ms = tl.load(part_ml + ((base + sp) * GP + g) * 2)
        f = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
        l += f * tl.load(part_ml + ((base + sp) * GP + g) * 2 + 1)
        acc += f[:, None] * tl.load(part_acc + ((base + sp) * GP + g)[:, None] * D + d[None, :])
    o = acc / l[:, None]
    tl.store(out + b * s_o_t + (kh * GROUP + g)[:, None] * s_o_h + d[None, :], o.to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])


@triton.jit
def prefill_kernel(q, k, v, k_scale, v_scale, k_zero, v_zero, page_table, seq_lens, q_starts, out, sm_scale,
                   s_q_t, s_q_h, s_o_t, s_o_h, s_pt_b, s_page, s_tok, s_head, c_page, c_tok, c_head,
                   KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """Program (b, query block, query head): BLOCK_M query rows of one sequence against its pages, causal."""
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(q_starts + b)
    q_len = tl.load(q_starts + b + 1) - q0
    if mb * BLOCK_M >= q_len:
        return
    n = tl.load(seq_lens + b)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    pos = n - q_len + rows  # absolute positions of the query rows
    d = tl.arange(0, D)
    kh = h // GROUP
    qv = tl.load(q + (q0 + rows)[:, None] * s_q_t + h * s_q_h + d[None, :], mask=rmask[:, None], other=0.0)
    qv = qv.to(tl.float32) * sm_scale
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    t = tl.arange(0, PS)
    last_pos = n - q_len + tl.minimum(mb * BLOCK_M + BLOCK_M, q_len) - 1
    for p in range(0, last_pos // PS + 1):
        page = tl.load(page_table + b * s_pt_b + p).to(tl.int64)
        kt = _load_page(k, k_scale, k_zero, page, 0, kh, s_page, s_tok, s_head, c_page, c_tok, c_head, KIND, PS, D)
        s = tl.dot(qv, tl.trans(kt))  # [BLOCK_M, PS]
        kpos = p * PS + t
        s = tl.where((kpos[None, :] <= pos[:, None]) & rmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(s - m_safe[:, None])
        vt = _load_page(v, v_scale, v_zero, page, 0, kh, s_page, s_tok, s_head, c_page, c_tok, c_head, KIND, PS, D)
        acc = acc * alpha[:, None] + tl.dot(w, vt)
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out + (q0 + rows)[:, None] * s_o_t + h * s_o_h + d[None, :], o.to(out.dtype.element_ty),
             mask=rmask[:, None])
