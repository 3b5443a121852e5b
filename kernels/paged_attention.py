"""Triton kernels over the paged KV cache: writing keys/values (quantizing on the way in) and attention.

KIND selects the page format (localpd/kvcache/formats.py): 0 float (fp32/fp16/bf16), 1 int8, 2 fp8 e4m3, 3 int4 (groups of 32,
two values a byte), 4 int4ch (int4 per channel of a page); the attention kernels take one for the keys (K_KIND)
and one for the values (V_KIND), each with its own strides. Packed values are read directly, a whole tile per
load, and dequantized in registers, so quantized KV moves fewer bytes (int4 as two half-width tiles, its low and
high nibbles; see decode_kernel). Decode (every sequence one query) splits each sequence's pages over several
programs (flash-decoding), each walking its tokens a tile of several pages at a time (scores and weighted sums as
tl.dot, the query group padded to 16 rows), and a reduce kernel merges each query head's partial softmaxes in one
step; the dots take half-precision queries' own type (kvcache.dispatch.attention_dot), and decode scores int8
keys by integer dots (int8_key_dots); prefill chunks tile queries by BLOCK_M and walk the key pages with an
online softmax and a causal mask. All
query heads that share a KV head are one program (GQA), in both: its keys and values are loaded once for the
group. Loads are masked at the sequence's end, so whatever lies past it (stale or never-written slots, padding in
the page table) is not read. rope_write_kv_kernel is a layer's whole step between its qkv projection and
attention: RoPE on the query heads in place, and the key heads rotated and the value heads written into their
pages, in one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from localpd.kernels.act_round import round_blocks, two_levels
from localpd.kernels.pdl import wait_prior

FLOAT, INT8, FP8, INT4 = 0, 1, 2, 3


@triton.jit
def _tile_pages(row, pos, lo, last, PS: tl.constexpr, WIDE: tl.constexpr):
    """The pages of tokens pos of a sequence (row: its page-table row) that a decode split reads, 0 elsewhere; as
    _page_ids types them."""
    return _page_ids(tl.load(row + pos // PS, mask=(pos < last) & (pos >= lo), other=0), WIDE)


@triton.jit
def _page_ids(pages, WIDE: tl.constexpr):
    """Page numbers as the type the kernels compute offsets in: int32, or int64 where WIDE (some tensor of the
    layer spans 2**31 elements; kvcache.dispatch.wide_offsets). int32 offsets keep a trip's 64-bit address pairs
    out of the decode loop (sm_90, Llama-3-8B heads: bf16 146 -> 105 registers, 9.6 -> 7.1 instructions a word).
    The prefill kernel keeps int64 offsets: at int32, ptxas spilled 8-16 bytes (outside the loop) in two of its
    launches (int4 heads of 64 on sm_86, int8/int4 heads of 96 on sm_90), for 3-7% fewer loop instructions."""
    return pages.to(tl.int64) if WIDE else pages.to(tl.int32)


@triton.jit
def _token_scales(scale, pages, offs, mask, head, c_page, c_tok, c_head):
    """The per-token scales of one KV head (int8, fp8) as float32 [len(pages)]."""
    return tl.load(scale + pages * c_page + offs * c_tok + head * c_head, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _factors(scale, zero, pages, pos, lo, last, head, c_page, c_tok, c_head, KIND: tl.constexpr, D: tl.constexpr,
             DP: tl.constexpr, PS: tl.constexpr):
    """The factors of tokens pos (pages: theirs) that a decode split reads, loaded a trip before the trip that uses
    them: per-token scales [T] (int8, fp8; 0s beside them for zeros), int4 groups' scales and zeros [T, DP / 32]
    (_int4_groups), 0s for other formats. The per-token scales are converted as loaded: as _page_factors' 16-bit
    patterns, int8's and fp8's at heads of 64 were packed in pairs in the trip that loaded them, so waited on there
    (a round trip a trip, sm_90)."""
    mask = (pos < last) & (pos >= lo)
    if KIND == 1 or KIND == 2:
        a = _token_scales(scale, pages, pos % PS, mask, head, c_page, c_tok, c_head)
        b = tl.zeros_like(a)
    elif KIND == 3:
        a, b = _int4_groups(scale, zero, pages, pos % PS, mask, head, c_page, c_tok, c_head, D, DP)
    else:
        a = tl.zeros(pos.shape, tl.float32)
        b = a
    return a, b


@triton.jit
def _page_factors(scale, zero, pages, mask, offs, head, c_page, c_tok, c_head, KIND: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr):
    """The factors of tokens (pages, offs) of one KV head as their float16 bits in int32s, so that they are loaded
    together and converted where they are used: per-token scales [len(pages)] (int8, fp8; _half_bits reads them;
    0s beside them), int4 groups' scales and zeros [len(pages), DP / 32] (_int4_groups), 0s for other formats.
    The prefill kernel's (a page a trip): converted as loaded (_factors), int8 took 489 instructions a page
    against 452 (sm_90)."""
    if KIND == 1 or KIND == 2:
        a = tl.load(scale.to(tl.pointer_type(tl.int16)) + pages * c_page + offs * c_tok + head * c_head, mask=mask,
                    other=0).to(tl.int32)
        b = tl.zeros_like(a)
    elif KIND == 3:
        a, b = _int4_groups(scale, zero, pages, offs, mask, head, c_page, c_tok, c_head, D, DP)
    else:
        a = tl.zeros(pages.shape, tl.int32)
        b = a
    return a, b


@triton.jit
def _half_bits(x):
    """float16 bits (the low 16 bits of int32s) as float32."""
    return x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_tokens(data, pages, offs, mask, head, s_page, s_tok, s_head, D: tl.constexpr, DP: tl.constexpr,
                 DOT: tl.constexpr):
    """Tokens (pages[i], offs[i]) of one KV head as DOT [len(pages), DP] (the dots' operand type, which holds every
    stored value exactly: bf16/fp16 pages, int8 codes, fp8 values): float pages as stored, int8 and fp8 without
    their per-token scale (the caller applies it to whole rows; int4 is read by _int4_dequant and _halves).
    Masked tokens read 0, so stale or never-written memory past a sequence's end cannot turn into NaN; so do the
    columns past the head's D elements where DP, the tile, is wider (heads of 96 in tiles of 128)."""
    d = tl.arange(0, DP)
    tok = pages[:, None] * s_page + offs[:, None] * s_tok + head * s_head
    return tl.load(data + tok + d[None, :], mask=mask[:, None] & (d < D)[None, :], other=0.0).to(DOT)


@triton.jit
def _byte_pairs(data, pages, offs, mask, head, s_page, s_tok, s_head, KIND: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr):
    """int8 codes or fp8 values of one KV head as two float16 tiles [len(pages), DP / 2]: the even elements and the
    odd ones, from 16-bit loads of a byte pair each (0 past the head's D elements). The values' dot reads its operand
    from shared memory with each thread's consecutive tokens of one channel packed together: 8-bit pages, a token's
    channels contiguous, were read there a byte at a time (128 LDS.U8 a 128-token trip a thread; there is no 8-bit
    transposing ldmatrix before sm_100), each byte in a register of its own; byte pairs stay a 16-bit operand on
    their way through shared memory, read by transposing ldmatrix, and split into even and odd in the dot's
    registers. int8 codes made float16 by their bits (_codes_as_half), fp8 e4m3 converted."""
    j = tl.arange(0, DP // 2)
    tok = (pages * s_page + offs * s_tok + head * s_head) // 2
    x = tl.load(data.to(tl.pointer_type(tl.int16)) + tok[:, None] + j[None, :],
                mask=mask[:, None] & (j < D // 2)[None, :], other=0).to(tl.uint16, bitcast=True)
    if KIND == 1:
        even, odd = _codes_as_half((x & 0xFF).to(tl.uint8)), _codes_as_half((x >> 8).to(tl.uint8))
    else:
        even = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _codes_as_half(c):
    """int8 codes [..] as float16, exactly and without an int-to-float conversion (I2F, a quarter of the FMA rate):
    each code's byte + 128 (its sign bit flipped) in the low mantissa bits of 1024.0 (0x6400) is 1152 + code."""
    u = (c.to(tl.uint8, bitcast=True).to(tl.int16) ^ 0x80) | 0x6400
    return u.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _rint(y):
    """Round half to even, as torch.round does (libdevice's rint is not available in the interpreter)."""
    r = tl.floor(y + 0.5)
    odd = (r - 2 * tl.floor(r * 0.5)) != 0
    return tl.where(((r - y) == 0.5) & odd, r - 1, r)


@triton.jit
def _head_values(src, idx, cos_row, sin_row, ROPE: tl.constexpr, HALF: tl.constexpr):
    """Elements idx of the head at src (2 * HALF wide) as float32, 0 for idx past its end (a tile wider than the
    head); with ROPE rotated (HF's half-rotated layout: element i pairs with i +- HALF) and rounded to src's dtype,
    exactly as rope_kernel would store them."""
    inside = idx < 2 * HALF
    x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
    if ROPE:
        first = idx < HALF
        other = tl.load(src + tl.where(first, idx + HALF, idx - HALF), mask=inside, other=0.0).to(tl.float32)
        c = tl.load(cos_row + idx % HALF, mask=inside, other=0.0).to(tl.float32)
        s = tl.load(sin_row + idx % HALF, mask=inside, other=0.0).to(tl.float32)
        x = tl.where(first, x * c - other * s, x * c + other * s).to(src.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _write_page_run(src, s_src_t, cos, sin, s_c, slots, t, T, data, scale, zero, h, s_page, s_tok, s_head, c_page,
                    c_head, stage, stage_slots, s_st_t, PS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    ROPE: tl.constexpr, STAGED: tl.constexpr):
    """int4ch, the program of token t (src: its head at token 0, rows s_src_t apart): if t is the first new token
    of its page in this step, re-quantize the page's earlier tokens together with the step's new ones over each
    channel's range across them (as localpd/kvcache/dispatch.py's _write_pages_ref); any other token's program does nothing.
    STAGED: the earlier tokens are read from the stage (stage: kv head h's row of slot 0, tokens s_st_t apart;
    stage_slots[t]: token t's slot there) and, if the page is left open, the new ones written to it; else the
    page's codes are dequantized."""
    slot = tl.load(slots + t)
    prev = tl.load(slots + t - 1, mask=t > 0, other=0)
    if (t == 0) | (prev // PS != slot // PS):
        page, off0 = slot // PS, slot % PS
        o = tl.arange(0, PS)
        j = tl.arange(0, DP // 2)  # byte j: channels 2j and 2j + 1
        jm = j < D // 2
        r = t + o - off0  # the row that would hold offset o if this page's new tokens are consecutive rows
        cand = (o >= off0) & (r < T)
        new = cand & (tl.load(slots + r, mask=cand, other=-1) == slot + o - off0)
        valid = (o < off0) | new
        r = tl.where(new, r, t)  # keep every pointer in bounds
        base = data + page * s_page + h * s_head
        cb = page * c_page + h * c_head
        new_even = _head_values(src + r[:, None] * s_src_t, 2 * j[None, :], cos + r[:, None] * s_c,
                                sin + r[:, None] * s_c, ROPE, D // 2)
        new_odd = _head_values(src + r[:, None] * s_src_t, 2 * j[None, :] + 1, cos + r[:, None] * s_c,
                               sin + r[:, None] * s_c, ROPE, D // 2)
        old = (o < off0)[:, None] & jm[None, :]
        if STAGED:
            staged = stage + (tl.load(stage_slots + t) - off0 + o)[:, None] * s_st_t  # offset o's staged row
            even = tl.where(new[:, None], new_even,
                            tl.load(staged + 2 * j[None, :], mask=old, other=0.0).to(tl.float32))
            odd = tl.where(new[:, None], new_odd,
                           tl.load(staged + 2 * j[None, :] + 1, mask=old, other=0.0).to(tl.float32))
            # only a page left open is staged: its sequence's last in this step (a full page is never rewritten)
            keep = (new & (tl.sum(valid.to(tl.int32), axis=0) + tl.zeros_like(o) < PS))[:, None] & jm[None, :]
            et = stage.dtype.element_ty
            tl.store(staged + 2 * j[None, :], new_even.to(et), mask=keep)
            tl.store(staged + 2 * j[None, :] + 1, new_odd.to(et), mask=keep)
        else:
            byte = tl.load(base + o[:, None] * s_tok + j[None, :], mask=old, other=0).to(tl.int32)
            even = tl.where(new[:, None], new_even,
                            (byte & 15).to(tl.float32) * _channels(scale + cb + 2 * j, jm)[None, :]
                            + _channels(zero + cb + 2 * j, jm)[None, :])
            odd = tl.where(new[:, None], new_odd,
                           ((byte >> 4) & 15).to(tl.float32) * _channels(scale + cb + 2 * j + 1, jm)[None, :]
                           + _channels(zero + cb + 2 * j + 1, jm)[None, :])
        tl.debug_barrier()  # every thread has read the page's old codes, scales and zeros before any is rewritten
        q_even = _quantize_channels(even, valid, scale + cb + 2 * j, zero + cb + 2 * j, jm)
        q_odd = _quantize_channels(odd, valid, scale + cb + 2 * j + 1, zero + cb + 2 * j + 1, jm)
        tl.store(base + o[:, None] * s_tok + j[None, :], (q_even | (q_odd << 4)).to(tl.uint8),
                 mask=valid[:, None] & jm[None, :])


@triton.jit
def _channels(ptrs, mask):
    """One float16 per channel (a page's scales or zeros) as float32, 0 where masked."""
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_channels(v, valid, scale_ptrs, zero_ptrs, cmask):
    """int4 codes of v [tokens, channels] with one scale and zero per channel over the valid tokens, stored for
    the channels cmask keeps."""
    lo = tl.min(tl.where(valid[:, None], v, float("inf")), axis=0)
    hi = tl.max(tl.where(valid[:, None], v, float("-inf")), axis=0)
    sc = ((hi - lo) / 15).to(tl.float16)
    zr = lo.to(tl.float16)
    tl.store(scale_ptrs, sc, mask=cmask)
    tl.store(zero_ptrs, zr, mask=cmask)
    sf = sc.to(tl.float32)
    return tl.clamp(_rint((v - zr.to(tl.float32)[None, :]) / tl.where(sf > 0, sf, 1.0)[None, :]), 0, 15).to(tl.int32)


@triton.jit
def _write_head(src, cos_row, sin_row, data, scale, zero, slot, h, s_page, s_tok, s_head, c_page, c_tok, c_head,
                KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROPE: tl.constexpr):
    """Quantize the head at src (rotated first with ROPE) into kv head h of its slot (D elements, in a tile of DP)."""
    page, off = slot // PS, slot % PS
    base = data + page * s_page + off * s_tok + h * s_head
    cbase = page * c_page + off * c_tok + h * c_head
    if KIND == 3:
        g = tl.arange(0, DP // 32)
        gm = (g < D // 32)[:, None]
        j = tl.arange(0, 16)
        idx = g[:, None] * 32 + 2 * j[None, :]  # [G, 16]: the even element of each byte
        lo = _head_values(src, idx, cos_row, sin_row, ROPE, D // 2)
        hi = _head_values(src, idx + 1, cos_row, sin_row, ROPE, D // 2)
        mn = tl.minimum(tl.min(lo, axis=1), tl.min(hi, axis=1))
        mx = tl.maximum(tl.max(lo, axis=1), tl.max(hi, axis=1))
        sc = ((mx - mn) / 15).to(tl.float16)
        zr = mn.to(tl.float16)
        sf = sc.to(tl.float32)
        safe = tl.where(sf > 0, sf, 1.0)
        qlo = tl.clamp(_rint((lo - zr.to(tl.float32)[:, None]) / safe[:, None]), 0, 15)
        qhi = tl.clamp(_rint((hi - zr.to(tl.float32)[:, None]) / safe[:, None]), 0, 15)
        packed = (qlo.to(tl.int32) | (qhi.to(tl.int32) << 4)).to(tl.uint8)
        tl.store(base + g[:, None] * 16 + j[None, :], packed, mask=gm)
        tl.store(scale + cbase + g, sc, mask=g < D // 32)
        tl.store(zero + cbase + g, zr, mask=g < D // 32)
    elif KIND == 0:
        d = tl.arange(0, DP)
        tl.store(base + d, _head_values(src, d, cos_row, sin_row, ROPE, D // 2).to(data.dtype.element_ty),
                 mask=d < D)
    else:
        d = tl.arange(0, DP)
        x = _head_values(src, d, cos_row, sin_row, ROPE, D // 2)
        top = 127.0 if KIND == 1 else 448.0
        sc = (tl.max(tl.abs(x), axis=0) / top).to(tl.float16)
        sf = sc.to(tl.float32)
        y = x / tl.where(sf > 0, sf, 1.0)
        if KIND == 1:
            tl.store(base + d, tl.clamp(_rint(y), -127, 127).to(tl.int8), mask=d < D)
        else:
            tl.store(base + d, tl.clamp(y, -448.0, 448.0).to(tl.float8e4nv), mask=d < D)
        tl.store(scale + cbase, sc)


@triton.jit
def write_kv_kernel(src, slots, data, scale, zero, stage, stage_slots, T, s_src_t, s_src_h, s_page, s_tok, s_head,
                    c_page, c_tok, c_head, s_st_t, s_st_h, KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                    DP: tl.constexpr, STAGED: tl.constexpr):
    """One program per (token, head): quantize x[D] into its slot (int4ch: the page's run, from its first token)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if KIND == 4:
        _write_page_run(src + h * s_src_h, s_src_t, src, src, 0, slots, t, T, data, scale, zero, h, s_page, s_tok,
                        s_head, c_page, c_head, stage + h * s_st_h, stage_slots, s_st_t, PS, D, DP, False, STAGED)
    else:
        _write_head(src + t * s_src_t + h * s_src_h, src, src, data, scale, zero, tl.load(slots + t), h, s_page,
                    s_tok, s_head, c_page, c_tok, c_head, KIND, PS, D, DP, False)


@triton.jit
def rope_write_kv_kernel(qkv, cos, sin, slots, k, v, k_scale, v_scale, k_zero, v_zero, k_stage, v_stage, stage_slots,
                         s_t, s_c, sk_page, sk_tok, sk_head, ck_page, ck_tok, ck_head, sv_page, sv_tok, sv_head,
                         cv_page, cv_tok, cv_head, sks_t, sks_h, svs_t, svs_h, HQ, H, T, K_KIND: tl.constexpr,
                         V_KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         K_STAGED: tl.constexpr, V_STAGED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, head) over a qkv row's HQ query, H key and H value heads: rotates a query head in place,
    writes a key head rotated and a value head as is into the token's slot (RoPE and the KV write in one launch;
    the key heads of qkv are left unrotated)."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = qkv + t * s_t
    cos_row, sin_row = cos + t * s_c, sin + t * s_c
    if h < HQ:
        d = tl.arange(0, DP)
        x = _head_values(row + h * D, d, cos_row, sin_row, True, D // 2)
        tl.store(row + h * D + d, x.to(qkv.dtype.element_ty), mask=d < D)
    elif h < HQ + H:
        if K_KIND == 4:
            _write_page_run(qkv + h * D, s_t, cos, sin, s_c, slots, t, T, k, k_scale, k_zero, h - HQ, sk_page, sk_tok,
                            sk_head, ck_page, ck_head, k_stage + (h - HQ) * sks_h, stage_slots, sks_t, PS, D, DP,
                            True, K_STAGED)
        else:
            _write_head(row + h * D, cos_row, sin_row, k, k_scale, k_zero, tl.load(slots + t), h - HQ, sk_page,
                        sk_tok, sk_head, ck_page, ck_tok, ck_head, K_KIND, PS, D, DP, True)
    else:
        if V_KIND == 4:
            _write_page_run(qkv + h * D, s_t, cos, sin, s_c, slots, t, T, v, v_scale, v_zero, h - HQ - H, sv_page,
                            sv_tok, sv_head, cv_page, cv_head, v_stage + (h - HQ - H) * svs_h, stage_slots, svs_t,
                            PS, D, DP, False, V_STAGED)
        else:
            _write_head(row + h * D, cos_row, sin_row, v, v_scale, v_zero, tl.load(slots + t), h - HQ - H, sv_page,
                        sv_tok, sv_head, cv_page, cv_tok, cv_head, V_KIND, PS, D, DP, False)


@triton.jit
def _int4_groups(scale, zero, pages, offs, mask, head, c_page, c_tok, c_head, D: tl.constexpr, DP: tl.constexpr):
    """The scales and zeros [len(pages), DP / 32] of grouped int4 tokens of one KV head (0 past the head's groups),
    each loaded as one contiguous tile per token, as their float16 bits in int32s (a 16-bit value loaded a trip
    ahead would otherwise be packed in pairs, so waited on, in the trip that loads it): _int4_dequant reads them."""
    g = tl.arange(0, DP // 32)
    off = pages[:, None] * c_page + offs[:, None] * c_tok + head * c_head + g[None, :]
    m = mask[:, None] & (g < D // 32)[None, :]
    sc = tl.load(scale.to(tl.pointer_type(tl.int16)) + off, mask=m, other=0).to(tl.int32)
    return sc, tl.load(zero.to(tl.pointer_type(tl.int16)) + off, mask=m, other=0).to(tl.int32)


@triton.jit
def _int4_dequant(data, sc, zr, pages, offs, mask, head, s_page, s_tok, s_head, D: tl.constexpr, DP: tl.constexpr,
                  HALF: tl.constexpr = False):
    """Grouped int4 tokens of one KV head, their groups' scales and zeros sc, zr given (_int4_groups' bits), as two
    float32 tiles [len(pages), DP / 2]: the even elements (each byte's low nibble) and the odd ones (its high
    nibble), 0 past the head's D elements, the bytes loaded as one contiguous tile per token. HALF: float16 tiles,
    code * scale + zero computed in float16 from codes made float16 without a conversion, two a mask from 4-byte
    words (_word_halves; heads are whole groups of 32, so a token's bytes start on a word)."""
    T: tl.constexpr = pages.shape[0]
    G: tl.constexpr = DP // 32
    OUT: tl.constexpr = tl.float16 if HALF else tl.float32
    sc3 = sc.to(tl.int16).to(tl.float16, bitcast=True).to(OUT)[:, :, None]  # a group's scale, broadcast over its
    zr3 = zr.to(tl.int16).to(tl.float16, bitcast=True).to(OUT)[:, :, None]  # 16 bytes in registers
    if HALF:  # 4 bytes a word: each mask-and-or makes two float16 1024 + code at once
        jw = tl.arange(0, DP // 8)
        w = tl.load(data.to(tl.pointer_type(tl.int32)) + ((pages * s_page + offs * s_tok + head * s_head) // 4)[:, None]
                    + jw[None, :], mask=mask[:, None] & (jw < D // 8)[None, :], other=0)
        lo = _word_halves(w & 0x000F000F, (w >> 8) & 0x000F000F, T, DP) - 1024.0  # exact: the codes
        hi = _word_halves((w >> 4) & 0x000F000F, (w >> 12) & 0x000F000F, T, DP) - 1024.0
    else:
        j = tl.arange(0, DP // 2)
        p = tl.load(data + pages[:, None] * s_page + offs[:, None] * s_tok + head * s_head + j[None, :],
                    mask=mask[:, None] & (j < D // 2)[None, :], other=0).to(tl.int32)
        lo, hi = (p & 15).to(OUT), (p >> 4).to(OUT)
    even = tl.reshape(tl.reshape(lo, (T, G, 16)) * sc3 + zr3, (T, DP // 2))
    odd = tl.reshape(tl.reshape(hi, (T, G, 16)) * sc3 + zr3, (T, DP // 2))
    return even, odd


@triton.jit
def _word_halves(a, b, T: tl.constexpr, DP: tl.constexpr):
    """[T, DP / 2] float16 from words a, b [T, DP / 8] holding a nibble in bits 0-3 and 16-19: a's of bytes 0 and
    2 of a word, b's of bytes 1 and 3, so output 4i + e is byte e's nibble of word i; each as 1024 + nibble."""
    a, b = a | 0x64006400, b | 0x64006400
    a0, a1 = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True), (a >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    b0, b1 = (b & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True), (b >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(tl.join(a0, a1), tl.join(b0, b1)), (T, DP // 2))  # join: a new last axis


@triton.jit
def _int4ch_halves(data, scale, zero, pages, offs, mask, head, s_page, s_tok, s_head, c_page, c_head,
                   D: tl.constexpr, DP: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr = False):
    """int4ch tokens of one KV head as _int4_dequant returns them, for tiles of whole pages (len(pages) a multiple
    of PS, starting on a page): each page's per-channel scales and zeros are loaded once, as int32 words holding
    an even and an odd channel's float16 each, and broadcast over the page's tokens in registers."""
    T: tl.constexpr = pages.shape[0]
    NP: tl.constexpr = T // PS
    j = tl.arange(0, DP // 2)
    jm = (j < D // 2)[None, :]
    pg = tl.max(tl.reshape(tl.where(mask, pages, 0), (NP, PS)), axis=1)  # each page's id (0 if none of it is read)
    live = (tl.max(tl.reshape(mask.to(tl.int32), (NP, PS)), axis=1) > 0)[:, None] & jm
    word = ((pg * c_page + head * c_head) // 2)[:, None] + j[None, :]  # [NP, D / 2]: channels 2j and 2j + 1
    sw = tl.load(scale.to(tl.pointer_type(tl.int32)) + word, mask=live, other=0)
    zw = tl.load(zero.to(tl.pointer_type(tl.int32)) + word, mask=live, other=0)
    if HALF:  # 4 bytes a word, two float16 codes a mask-and-or (_word_halves), as _int4_dequant's: each byte in an
        # int32 of its own and each nibble made float16 alone took 47.2 instructions a word (decode, int4ch keys and
        # values, sm_90; now 38.0) and the prefill kernel 828 a page over int4ch/int4 on sm_86 (now 528)
        jw = tl.arange(0, DP // 8)
        w = tl.load(data.to(tl.pointer_type(tl.int32)) + ((pages * s_page + offs * s_tok + head * s_head) // 4)[:, None]
                    + jw[None, :], mask=mask[:, None] & (jw < D // 8)[None, :], other=0)
        lo = _word_halves(w & 0x000F000F, (w >> 8) & 0x000F000F, T, DP) - 1024.0
        hi = _word_halves((w >> 4) & 0x000F000F, (w >> 12) & 0x000F000F, T, DP) - 1024.0
    else:
        p = tl.load(data + pages[:, None] * s_page + offs[:, None] * s_tok + head * s_head + j[None, :],
                    mask=mask[:, None] & jm, other=0).to(tl.int32)
        lo, hi = (p & 15).to(tl.float32), (p >> 4).to(tl.float32)
    return _page_channels(lo, sw, zw, PS), _page_channels(hi, sw >> 16, zw >> 16, PS)


@triton.jit
def _page_channels(codes, scale_bits, zero_bits, PS: tl.constexpr):
    """codes [T, C] (int4 codes as float16 or float32) * scale + zero in their type, the scale and zero [T / PS, C]
    given as float16 bits (the low 16 bits of each int32), one row a page."""
    T: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    sc = (scale_bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(codes.dtype)
    zr = (zero_bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(codes.dtype)
    return tl.reshape(tl.reshape(codes, (T // PS, PS, C)) * sc[:, None, :] + zr[:, None, :], (T, C))


@triton.jit
def _halves(data, scale, zero, pages, offs, mask, head, s_page, s_tok, s_head, c_page, c_head, D: tl.constexpr,
            DP: tl.constexpr, PS: tl.constexpr, DOT: tl.constexpr):
    """The even and odd elements of int4ch tokens as DOT [len(pages), DP / 2] (_int4ch_halves'), dequantized in
    float32, or in float16 where DOT is float16."""
    even, odd = _int4ch_halves(data, scale, zero, pages, offs, mask, head, s_page, s_tok, s_head, c_page, c_head, D,
                               DP, PS, DOT == tl.float16)
    return even.to(DOT), odd.to(DOT)


@triton.jit
def _query_tiles(q_rows, mask, sm_scale, D: tl.constexpr, DP: tl.constexpr, DOT: tl.constexpr):
    """Query rows (q_rows: each row's first element) times sm_scale in float32, as DOT: whole [rows, DP], and their
    even and odd elements [rows, DP / 2] for int4 keys (unused loads are compiled away); 0 past the head's D."""
    d = tl.arange(0, DP)
    h2 = tl.arange(0, DP // 2)
    m = mask[:, None]
    whole = tl.load(q_rows + d[None, :], mask=m & (d < D)[None, :], other=0.0).to(tl.float32) * sm_scale
    m2 = m & (h2 < D // 2)[None, :]
    even = tl.load(q_rows + 2 * h2[None, :], mask=m2, other=0.0).to(tl.float32) * sm_scale
    odd = tl.load(q_rows + 2 * h2[None, :] + 1, mask=m2, other=0.0).to(tl.float32) * sm_scale
    return whole.to(DOT), even.to(DOT), odd.to(DOT)


@triton.jit
def _store_rows(rows, acc, acc_even, acc_odd, mask, HALVES: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """The first D columns of acc [rows, DP] at rows (each row's first element) in their dtype, or with HALVES the
    even and odd elements (int4 values' two accumulators) interleaved."""
    et = rows.dtype.element_ty
    m = mask[:, None]
    if HALVES:
        h2 = tl.arange(0, DP // 2)
        m2 = m & (h2 < D // 2)[None, :]
        tl.store(rows + 2 * h2[None, :], acc_even.to(et), mask=m2)
        tl.store(rows + 2 * h2[None, :] + 1, acc_odd.to(et), mask=m2)
    else:
        d = tl.arange(0, DP)
        tl.store(rows + d[None, :], acc.to(et), mask=m & (d < D)[None, :])


@triton.jit
def decode_kernel(q, k, v, k_scale, v_scale, k_zero, v_zero, page_table, seq_lens, part_acc, part_ml, sm_scale,
                  s_q_t, s_q_h, s_pt_b, sk_page, sk_tok, sk_head, ck_page, ck_tok, ck_head,
                  sv_page, sv_tok, sv_head, cv_page, cv_tok, cv_head, SPLITS, window,
                  K_KIND: tl.constexpr, V_KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr,
                  INT8_KEYS: tl.constexpr, PDL: tl.constexpr = False, HALF_VALUES: tl.constexpr = True,
                  WIDE: tl.constexpr = False):
    """Program (b, kv head, split): the group's queries (padded to GP >= 16 rows for tl.dot) against this split's
    tokens, BLOCK_T at a time across several pages; partial softmax results out. The splits share out the
    sequence's own tokens in whole tiles (its length read here, not the page table's width: a CUDA graph's table
    spans the whole context, and a 4k sequence in a 128k table would otherwise keep one split of SPLITS busy).

    The tiles go into the dots as stored, in DOT (the queries' type where it is bf16/fp16: tensor-core dots at
    twice tf32's rate, the softmax weights rounded to it), and each format's scales are applied where they cost
    least: a per-token scale (int8, fp8) multiplies the scores (keys) or the softmax weights (values), not every
    element; grouped int4 is taken as its low and high nibbles, two half-width tiles (even and odd elements), with
    the query split the same way (keys) or two half-width accumulators (values). INT8_KEYS: int8 keys meet each
    query head rounded to two int8 levels in two integer dots, so the codes need no conversion at all.
    HALF_VALUES (where DOT is 16-bit): int8, fp8 and int4 values go into their dot in float16 with the softmax
    weights, and fp8 and int4 keys into theirs with float16 queries (int4: their halves), the codes made float16
    by their bits (_codes_as_half, _word_halves) as loaded, fp8 converted in one instruction a pair, int4's
    scale and zero applied in float16; as exact as bf16 for int8 codes and fp8 values, int4's values, the weights
    and the queries rounded 3 bits finer. int8 and fp8 values are loaded as byte pairs, their even and odd
    elements in two accumulators as int4's halves are (_byte_pairs: the dot's operand stays 16-bit through shared
    memory).
    window > 0: the query sees its last `window` keys only (a sliding-window layer), and the splits share out those
    keys from the start of the page the first of them is in (kvcache.dispatch.decode_span), not the whole
    sequence. WIDE: offsets into the pages in int64 (_page_ids)."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(seq_lens + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)  # the first key the query sees
    start = lo // PS * PS  # whole pages
    per_split = tl.cdiv(tl.cdiv(n - start, BLOCK_T), SPLITS) * BLOCK_T  # tokens a split, in whole tiles
    first = start + sp * per_split
    last = tl.minimum(first + per_split, n)
    g = tl.arange(0, GP)
    gmask = g < GROUP
    K_INT4: tl.constexpr = K_KIND == 3 or K_KIND == 4
    V_INT4: tl.constexpr = V_KIND == 3 or V_KIND == 4
    # int8, fp8 and int4 values meet float16 softmax weights where DOT is 16-bit (int8 codes and fp8 values exact
    # either way, int4's code * scale + zero and the weights 3 bits finer than bf16's), int8's and int4's codes
    # made float16 without a conversion; fp8 e4m3 converts to float16 in one instruction a pair, where bfloat16
    # took a second conversion each (sm_90: 256 F2F.BF16.F16 a 128-token trip, a thread)
    V_HALF: tl.constexpr = (V_KIND == 1 or V_KIND == 2 or V_INT4) and DOT != tl.float32 and HALF_VALUES
    VDOT: tl.constexpr = tl.float16 if V_HALF else DOT
    # int4 and fp8 keys likewise, with the queries in float16 (scaled queries of a model stay far inside its range)
    KDOT: tl.constexpr = tl.float16 if (K_INT4 or K_KIND == 2) and DOT != tl.float32 and HALF_VALUES else DOT
    q_rows = q + b * s_q_t + (kh * GROUP + g)[:, None] * s_q_h
    if INT8_KEYS:  # each query head rounded to two int8 levels (act_round.two_levels), ~15 bits
        q_hi, q_lo, q_step = two_levels(_query_tiles(q_rows, gmask, sm_scale, D, DP, tl.float32)[0])
        q_hi, q_lo = q_hi.to(tl.int8), q_lo.to(tl.int8)
    else:
        qv, q_even, q_odd = _query_tiles(q_rows, gmask, sm_scale, D, DP, KDOT)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    acc_even = tl.zeros((GP, DP // 2), tl.float32)  # int4 values: the even and odd output elements
    acc_odd = tl.zeros((GP, DP // 2), tl.float32)
    t = tl.arange(0, BLOCK_T)
    # The formats' factors (int8's and fp8's per-token scales, int4 groups' scales and zeros) are 2-byte loads,
    # too narrow for the pipeliner's asynchronous copies: loaded in the trip that used them, each trip waited on
    # DRAM round trips in turn (2 for int8, 4 for int4: keys', then values'). They are loaded a trip ahead in
    # registers instead, from pages loaded two trips ahead, so no load of a trip waits on another.
    AHEAD: tl.constexpr = (K_KIND >= 1 and K_KIND <= 3) or (V_KIND >= 1 and V_KIND <= 3)
    K_HALF: tl.constexpr = KDOT == tl.float16
    V_HALF4: tl.constexpr = VDOT == tl.float16
    V_PAIRS: tl.constexpr = (V_KIND == 1 or V_KIND == 2) and V_HALF  # _byte_pairs
    V_SPLIT: tl.constexpr = V_INT4 or V_PAIRS  # the values' even and odd elements in two accumulators
    OWN: tl.constexpr = K_KIND == 0 or K_KIND == 2 or V_KIND == 0 or V_KIND == 2  # a float side (below)
    pt_row = page_table + b * s_pt_b
    if AHEAD:
        pg_ahead = _tile_pages(pt_row, first + t, lo, last, PS, WIDE)
        ka_ahead, kb_ahead = _factors(k_scale, k_zero, pg_ahead, first + t, lo, last, kh, ck_page, ck_tok, ck_head,
                                      K_KIND, D, DP, PS)
        va_ahead, vb_ahead = _factors(v_scale, v_zero, pg_ahead, first + t, lo, last, kh, cv_page, cv_tok, cv_head,
                                      V_KIND, D, DP, PS)
        pg_ahead = _tile_pages(pt_row, first + BLOCK_T + t, lo, last, PS, WIDE)
    for t0 in range(first, last, BLOCK_T):
        if AHEAD:  # this trip's factors; the next trip's, from its pages; the pages of the one after
            ka, kb, va, vb = ka_ahead, kb_ahead, va_ahead, vb_ahead
            nxt = t0 + BLOCK_T + t
            ka_ahead, kb_ahead = _factors(k_scale, k_zero, pg_ahead, nxt, lo, last, kh, ck_page, ck_tok, ck_head,
                                          K_KIND, D, DP, PS)
            va_ahead, vb_ahead = _factors(v_scale, v_zero, pg_ahead, nxt, lo, last, kh, cv_page, cv_tok, cv_head,
                                          V_KIND, D, DP, PS)
            pg_ahead = _tile_pages(pt_row, nxt + BLOCK_T, lo, last, PS, WIDE)
        pos = t0 + t
        tmask = (pos < last) & (pos >= lo)
        if OWN:  # every position reads one of the split's own tokens (a trip has one): a masked one the nearest
            own = tl.minimum(tl.maximum(pos, lo), last - 1)
            pages = _page_ids(tl.load(pt_row + own // PS), WIDE)
            offs = own % PS
        else:  # a position past the split's end (or before its window) reads page 0
            pages = _page_ids(tl.load(pt_row + pos // PS, mask=tmask, other=0), WIDE)
            offs = pos % PS
        # Tiles are read whole, without masks, where what a masked position reads weighs nothing: its score is
        # masked, and its values meet a weight of 0, so they must be finite. int8 and grouped int4 codes are (page
        # 0's, their factors masked to 0); a float or fp8 page's stale bits may be NaN, so those layers read a token
        # the split weighs anyway (OWN), non-finite only where the output already is. The masks' predicates had held
        # 15 registers through the trip (int8, sm_90); fp8's took 141 registers (now 128), bf16 7.1 instructions a
        # word (now 6.3)
        k_codes = tmask | (OWN or K_KIND == 1 or K_KIND == 3)
        v_codes = tmask | (OWN or V_KIND == 1 or V_KIND == 3)
        if K_KIND == 3:
            k_even, k_odd = _int4_dequant(k, ka, kb, pages, offs, k_codes, kh, sk_page, sk_tok, sk_head, D, DP, K_HALF)
            k_even, k_odd = k_even.to(KDOT), k_odd.to(KDOT)
        elif K_INT4:
            k_even, k_odd = _halves(k, k_scale, k_zero, pages, offs, k_codes, kh, sk_page, sk_tok, sk_head, ck_page,
                                    ck_head, D, DP, PS, KDOT)
        else:
            kt = _load_tokens(k, pages, offs, k_codes, kh, sk_page, sk_tok, sk_head, D, DP,
                              tl.int8 if INT8_KEYS else KDOT)
        if INT8_KEYS:  # integer dots of the codes: the keys go in as stored, no conversion
            s = (tl.dot(q_hi, tl.trans(kt)) * 256 + tl.dot(q_lo, tl.trans(kt))).to(tl.float32) * q_step[:, None]
        elif K_INT4:
            s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))  # [GP, BLOCK_T]
        else:
            s = tl.dot(qv, tl.trans(kt))
        if K_KIND == 1 or K_KIND == 2:
            s = s * ka[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))  # every tile has a valid token
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        w = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
        if V_KIND == 1 or V_KIND == 2:
            w = w * va[None, :]
        w = w.to(VDOT)
        # the values' operand is read (from the pipeliner's copy, requested a stage ahead with the keys') after the
        # scores: read before them, it was held through the keys' math (sm_90, Llama-3-8B heads: int8 174 -> 139
        # registers, int8/int4 210 -> 166, int4ch/int4 202 -> 167)
        if V_KIND == 3:
            v_even, v_odd = _int4_dequant(v, va, vb, pages, offs, v_codes, kh, sv_page, sv_tok, sv_head, D, DP, V_HALF4)
            v_even, v_odd = v_even.to(VDOT), v_odd.to(VDOT)
        elif V_INT4:
            v_even, v_odd = _halves(v, v_scale, v_zero, pages, offs, v_codes, kh, sv_page, sv_tok, sv_head, cv_page,
                                    cv_head, D, DP, PS, VDOT)
        elif V_PAIRS:
            v_even, v_odd = _byte_pairs(v, pages, offs, v_codes, kh, sv_page, sv_tok, sv_head, V_KIND, D, DP)
        else:
            vt = _load_tokens(v, pages, offs, v_codes, kh, sv_page, sv_tok, sv_head, D, DP, VDOT)
        if V_SPLIT:
            acc_even = acc_even * alpha[:, None] + tl.dot(w, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(w, v_odd)
        else:
            acc = acc * alpha[:, None] + tl.dot(w, vt)
    # [B, query heads, SPLITS]: the group's real rows only, each head's splits side by side for the reduce
    row = ((b * tl.num_programs(1) + kh) * GROUP + g) * SPLITS + sp
    _store_rows(part_acc + row[:, None] * D, acc, acc_even, acc_odd, gmask, V_SPLIT, D, DP)
    tl.store(part_ml + row * 2, m, mask=gmask)
    tl.store(part_ml + row * 2 + 1, l, mask=gmask)


@triton.jit
def decode_reduce_kernel(part_acc, part_ml, out, s_o_t, s_o_h, SPLITS, rq, rs, s_rq, s_rs, D: tl.constexpr,
                         DP: tl.constexpr, SP: tl.constexpr, ROUND_BITS: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (b, query head): merge the head's SPLITS partial softmaxes (padded to SP, a power of two) into its
    output row. They are loaded as one tile: a loop over the splits would wait on a round trip for each. With
    ROUND_BITS (4 or 8; D a multiple of 32) the row is also rounded for the o projection's integer GEMV into rq, rs
    (kernels/act_round.py: the head's D / 32 blocks of row b of the [T, heads * D] input), as quantize_act would
    round what it writes, so the GEMV's input needs no launch of its own."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    live = sp < SPLITS
    row = (b * tl.num_programs(1) + h) * SPLITS + sp
    ms = tl.load(part_ml + row * 2, mask=live, other=float("-inf"))
    f = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - tl.max(ms, axis=0)))  # empty splits weigh nothing
    l = tl.sum(f * tl.load(part_ml + row * 2 + 1, mask=live, other=0.0), axis=0)
    acc = tl.load(part_acc + row[:, None] * D + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
    o = (tl.sum(f[:, None] * acc, axis=0) / tl.where(l > 0, l, 1.0)).to(out.dtype.element_ty)
    tl.store(out + b * s_o_t + h * s_o_h + d, o, mask=d < D)
    if ROUND_BITS:
        blk = tl.arange(0, DP // 32)
        round_blocks(tl.reshape(o.to(tl.float32), (DP // 32, 32)), h * (D // 32) + blk, blk < D // 32,
                     rq + b.to(tl.int64) * s_rq, rs + b.to(tl.int64) * s_rs, DP // 32, ROUND_BITS)


@triton.jit
def prefill_kernel(q, k, v, k_scale, v_scale, k_zero, v_zero, page_table, seq_lens, q_starts, out, sm_scale,
                   s_q_t, s_q_h, s_o_t, s_o_h, s_pt_b, sk_page, sk_tok, sk_head, ck_page, ck_tok, ck_head,
                   sv_page, sv_tok, sv_head, cv_page, cv_tok, cv_head, window,
                   K_KIND: tl.constexpr, V_KIND: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr,
                   HALF_VALUES: tl.constexpr = True, WIDE: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """Program (b, query block, kv head): BLOCK_M query rows of one sequence for each of the GROUP query heads that
    share the kv head (GP * BLOCK_M rows, the group padded to GP, a power of two), against its pages, causal: each
    page is read once for the group, not once per query head. Scales, int4 halves and HALF_VALUES (for int4 keys
    and values) as in decode_kernel.
    window > 0: each query sees its last `window` keys only; pages before the block's first query's are skipped.
    The codes' offsets are int64 (_page_ids); WIDE: the factors' too. PAIRS: int8 and fp8 values as byte pairs
    (_byte_pairs), where the card's dots would read them from shared memory a byte at a time."""
    b = tl.program_id(0)
    mb = tl.program_id(1)
    kh = tl.program_id(2)
    q0 = tl.load(q_starts + b)
    q_len = tl.load(q_starts + b + 1) - q0
    if mb * BLOCK_M >= q_len:
        return
    n = tl.load(seq_lens + b)
    r = tl.arange(0, GP * BLOCK_M)
    h = kh * GROUP + r // BLOCK_M  # row r: query head r // BLOCK_M of the group, query row r % BLOCK_M
    rows = mb * BLOCK_M + r % BLOCK_M
    rmask = (rows < q_len) & (r // BLOCK_M < GROUP)
    pos = n - q_len + rows  # absolute positions of the query rows
    K_INT4: tl.constexpr = K_KIND == 3 or K_KIND == 4
    V_INT4: tl.constexpr = V_KIND == 3 or V_KIND == 4
    # int4 and fp8 (one conversion a pair to float16; bfloat16 took a second each: 462 -> 415 instructions a page on
    # sm_90), int8 only as byte pairs: its values' bits-made float16 compiled to more instructions on sm_90 than
    # Triton's conversion (480 against 462), where the decode kernel's 128-token tiles took fewer. PAIRS (cards
    # before sm_90, kvcache.dispatch.prefill_value_pairs): int8 and fp8 values as byte pairs (_byte_pairs)
    V_HALF: tl.constexpr = (V_INT4 or V_KIND == 2 or (V_KIND == 1 and PAIRS)) and DOT != tl.float32 and HALF_VALUES
    VDOT: tl.constexpr = tl.float16 if V_HALF else DOT
    V_PAIRS: tl.constexpr = (V_KIND == 1 or V_KIND == 2) and V_HALF and PAIRS
    KDOT: tl.constexpr = tl.float16 if (K_INT4 or K_KIND == 2) and DOT != tl.float32 and HALF_VALUES else DOT
    q_rows = q + (q0 + rows)[:, None] * s_q_t + h[:, None] * s_q_h
    qv, q_even, q_odd = _query_tiles(q_rows, rmask, sm_scale, D, DP, KDOT)
    m = tl.full((GP * BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((GP * BLOCK_M,), tl.float32)
    acc = tl.zeros((GP * BLOCK_M, DP), tl.float32)
    acc_even = tl.zeros((GP * BLOCK_M, DP // 2), tl.float32)
    acc_odd = tl.zeros((GP * BLOCK_M, DP // 2), tl.float32)
    t = tl.arange(0, PS)
    last_pos = n - q_len + tl.minimum(mb * BLOCK_M + BLOCK_M, q_len) - 1
    lo = tl.where(window > 0, tl.maximum(n - q_len + mb * BLOCK_M - window + 1, 0), 0)
    pt_row = page_table + b * s_pt_b
    for p in range(lo // PS, last_pos // PS + 1):
        page = tl.load(pt_row + p)
        pages = page.to(tl.int64) + tl.zeros((PS,), tl.int64)
        kmask = p * PS + t < n
        # the page's factors (int8's and fp8's per-token scales, grouped int4's scales and zeros) loaded together
        # before its codes are read, as raw 16-bit patterns: loaded where each was used, the trip waited on DRAM
        # round trips in turn (sm_90, Llama-3-8B heads: int8 and fp8 4 -> 1, int4 2 -> 1; sm_86 int8 3 -> 1)
        pg = _page_ids(page + tl.zeros((PS,), tl.int32), WIDE)
        ka, kb = _page_factors(k_scale, k_zero, pg, kmask, t, kh, ck_page, ck_tok, ck_head, K_KIND, D, DP)
        va, vb = _page_factors(v_scale, v_zero, pg, kmask, t, kh, cv_page, cv_tok, cv_head, V_KIND, D, DP)
        if K_KIND == 3:
            k_even, k_odd = _int4_dequant(k, ka, kb, pages, t, kmask, kh, sk_page, sk_tok, sk_head, D, DP,
                                          KDOT == tl.float16)
            s = tl.dot(q_even, tl.trans(k_even.to(KDOT))) + tl.dot(q_odd, tl.trans(k_odd.to(KDOT)))
        elif K_INT4:
            k_even, k_odd = _halves(k, k_scale, k_zero, pages, t, kmask, kh, sk_page, sk_tok, sk_head, ck_page,
                                    ck_head, D, DP, PS, KDOT)
            s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))  # [BLOCK_M, PS]
        else:
            kt = _load_tokens(k, pages, t, kmask, kh, sk_page, sk_tok, sk_head, D, DP, KDOT)
            s = tl.dot(qv, tl.trans(kt))
        if K_KIND == 1 or K_KIND == 2:
            s = s * _half_bits(ka)[None, :]
        kpos = p * PS + t
        seen = (kpos[None, :] <= pos[:, None]) & ((window == 0) | (kpos[None, :] > pos[:, None] - window))
        s = tl.where(seen & rmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
        if V_KIND == 1 or V_KIND == 2:
            w = w * _half_bits(va)[None, :]
        w = w.to(VDOT)
        if V_KIND == 3:
            v_even, v_odd = _int4_dequant(v, va, vb, pages, t, kmask, kh, sv_page, sv_tok, sv_head, D, DP,
                                          VDOT == tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(w, v_even.to(VDOT))
            acc_odd = acc_odd * alpha[:, None] + tl.dot(w, v_odd.to(VDOT))
        elif V_INT4 or V_PAIRS:
            if V_PAIRS:
                v_even, v_odd = _byte_pairs(v, pages, t, kmask, kh, sv_page, sv_tok, sv_head, V_KIND, D, DP)
            else:
                v_even, v_odd = _halves(v, v_scale, v_zero, pages, t, kmask, kh, sv_page, sv_tok, sv_head, cv_page,
                                        cv_head, D, DP, PS, VDOT)
            acc_even = acc_even * alpha[:, None] + tl.dot(w, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(w, v_odd)
        else:
            vt = _load_tokens(v, pages, t, kmask, kh, sv_page, sv_tok, sv_head, D, DP, VDOT)
            acc = acc * alpha[:, None] + tl.dot(w, vt)
    inv = 1.0 / tl.where(l > 0, l, 1.0)[:, None]
    _store_rows(out + (q0 + rows)[:, None] * s_o_t + h[:, None] * s_o_h, acc * inv, acc_even * inv, acc_odd * inv,
                rmask, V_INT4 or V_PAIRS, D, DP)
