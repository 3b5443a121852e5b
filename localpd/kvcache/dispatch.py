"""Writing keys and values into KV pages and attending over them: the torch references, and launchers of the
Triton kernels (CUDA) and of localpd's CPU kernels (fp32 pages; kernels/cpu.py).

paged_attention serves every kind of step: query rows are B sequences concatenated (q_starts), sequence b's
keys are positions 0 .. seq_lens[b] - 1 (its new tokens' included, written first), and query row j of a
sequence with q_len rows sits at position seq_lens[b] - q_len + j and attends causally up to it. Decode is
q_len = 1; a prefill chunk after a cached prefix is q_len > 1; a step may mix both. GQA: query head h reads
kv head h // (Hq // H).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from localpd.kernels import cpu
from localpd.kernels.dispatch import cdiv, device_arch, sm_count, use_triton
from localpd.kernels.fused_dispatch import rope, triton_block
from localpd.kvcache.formats import PER_PAGE, KVLayer, dequantize_kv, quantize_kv


def _pick(t, pages, offs):
    return None if t is None else t[pages, offs]


def _sides(layer: KVLayer):
    """(data, scale, zero, format) of the keys, then of the values."""
    return ((layer.k, layer.k_scale, layer.k_zero, layer.k_format),
            (layer.v, layer.v_scale, layer.v_zero, layer.v_format))


def _write_pages_ref(x, data, scale, zero, slots, page_size, stage=None, stage_slots=None) -> None:
    """int4ch: every page a write touches is re-quantized whole, its earlier tokens with the new ones, over each
    channel's range across them; offsets past the last new token are left as they were. The earlier tokens come
    from the stage where one is given (stage_slots[i]: token i's place in it, its page's offset 0 at
    stage_slots[i] - its offset; the new tokens of a page left open are staged too), else from the page's codes,
    dequantized."""
    pages, offs = slots // page_size, slots % page_size
    scale, zero = scale[:, 0], zero[:, 0]  # [n_pages, heads, head_dim]: the storage behind the per-token view
    touched, which = torch.unique(pages, return_inverse=True)
    last = torch.zeros(touched.shape, dtype=offs.dtype, device=offs.device).scatter_reduce(0, which, offs, "amax")
    if stage is None or stage_slots is None:
        vals = dequantize_kv(data[touched], scale[touched, None], zero[touched, None], "int4ch", torch.float32)
    else:
        first = torch.zeros_like(touched).scatter(0, which, stage_slots - offs)  # each page's offset 0 in the stage
        vals = stage[first[:, None] + torch.arange(page_size, device=offs.device)].float()
        still_open = last[which] < page_size - 1  # a full page is final; a sequence has one open page at most
        stage[stage_slots[still_open]] = x[still_open].to(stage.dtype)
    vals[which, offs] = x.float()
    # a page belongs to one sequence, which fills it in order: every offset up to the last new one holds a token
    valid = (torch.arange(page_size, device=offs.device)[None] <= last[:, None])[:, :, None, None]
    q, s, z = _round_pages(vals, valid, scale.dtype, zero.dtype)
    q = torch.where(valid, q, 0).to(torch.uint8)
    data[touched] = torch.where(valid, q[..., 0::2] | (q[..., 1::2] << 4), data[touched])
    scale[touched], zero[touched] = s, z


def _round_pages(vals: torch.Tensor, valid: torch.Tensor, scale_dtype, zero_dtype):
    """int4ch's rounding of pages [pages, page_size, H, D] (float32) over their valid tokens (valid: [pages,
    page_size, 1, 1]): codes 0..15 as floats [pages, page_size, H, D], and each channel's scale and zero [pages, H,
    D] in their storage dtypes. The values read back are codes * scale + zero (formats.dequantize_kv)."""
    lo = torch.where(valid, vals, torch.inf).amin(1)
    hi = torch.where(valid, vals, -torch.inf).amax(1)
    s = ((hi - lo) / 15).to(scale_dtype)
    z = lo.to(zero_dtype)
    sf = s.float()[:, None]
    q = ((vals - z.float()[:, None]) / torch.where(sf > 0, sf, torch.ones_like(sf))).round().clamp(0, 15)
    return q, s, z


def _write_side_ref(x, data, scale, zero, fmt, slots, page_size, stage=None, stage_slots=None) -> None:
    if fmt in PER_PAGE:
        return _write_pages_ref(x, data, scale, zero, slots, page_size, stage, stage_slots)
    pages, offs = slots // page_size, slots % page_size
    q, s, z = quantize_kv(x, fmt)
    data[pages, offs] = q
    if s is not None:
        scale[pages, offs] = s
    if z is not None:
        zero[pages, offs] = z


def write_kv_ref(layer: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                 stage_slots: torch.Tensor | None = None) -> None:
    """k, v [T, H, D] into the slots (page * page_size + offset) [T], quantized to the layer's formats.
    stage_slots [T]: each token's place in the layer's stage (per-page formats; see kvcache.formats), or None."""
    for x, side, stage in zip((k, v), _sides(layer), (layer.k_stage, layer.v_stage)):
        _write_side_ref(x, *side, slots, layer.page_size, stage, stage_slots)


def gather_kv(layer: KVLayer, pages: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n positions of a sequence whose pages are `pages`, dequantized: K, V [n, H, D]."""

    def pick(t):  # index_select: 1.5-3x faster than t[pages] on the CPU
        return None if t is None else t.index_select(0, pages).flatten(0, 1)[:n]

    def one(data, scale, zero, fmt):
        return dequantize_kv(pick(data), pick(scale), pick(zero), fmt, dtype)

    k, v = (one(*side) for side in _sides(layer))
    return k, v


# A sequence's query rows up to this many are each computed as a decode step computes its one row (SDPA over the
# keys up to its own, no mask): a verification step's rows (engine.speculate: at most MAX_DRAFT + 1) then give
# plain decoding's sums exactly. One masked call over them sums in another order, and over int8/int4 pages that
# difference flips keys' codes in later layers: logits moved by up to 0.1 (SmolLM2-135M, docs/PERF.md issue 30).
ROWS_AS_DECODE = 16


def paged_attention_ref(q: torch.Tensor, layer: KVLayer, page_table: torch.Tensor, seq_lens: torch.Tensor,
                        q_starts: torch.Tensor, scale: float, window: int = 0,
                        stage_slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; softmax in float32 for half-precision inputs (SDPA's own). window > 0: each
    query sees its last `window` keys (itself included) only. stage_slots [T]: the step's tokens' places in the
    layer's stage (per-page formats), so that a sequence's few rows see its open page as their decode steps did
    (_as_decode_page)."""
    out = torch.empty_like(q)
    ps = layer.page_size
    lens, starts = seq_lens.tolist(), q_starts.tolist()
    for b, n in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        t = e - s
        k, v = gather_kv(layer, page_table[b, :-(-n // ps)].long(), n, q.dtype)
        if t <= ROWS_AS_DECODE:
            for i in range(t):
                ki, vi = k[:n - t + i + 1], v[:n - t + i + 1]
                if i < t - 1 and stage_slots is not None and per_page((layer.k_format, layer.v_format)):
                    ki, vi = _as_decode_page(layer, ki, vi, int(stage_slots[s + i]), n)
                out[s + i] = decode_row(q[s + i], ki, vi, scale, window)
            continue
        # 4-D inputs (a batch of one) let the CPU take SDPA's fused kernel, where 3-D ones took its general path:
        # 3-4x slower
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
        if 0 < window < n:
            mask &= torch.ones(t, n, dtype=torch.bool, device=q.device).triu(diagonal=n - t - window + 1)
        o = F.scaled_dot_product_attention(q[None, s:e].transpose(1, 2), k[None].transpose(1, 2),
                                           v[None].transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def _as_decode_page(layer: KVLayer, k: torch.Tensor, v: torch.Tensor, slot: int, n: int):
    """A verification row's keys and values k, v [m, H, D] (its own the last; not the step's last row, which sees
    what the write made) with its page's per-page sides as its decode step saw them: rounded over the page's tokens
    up to its own, from their staged values (slot: its own stage slot), where the step's write rounded them over
    the later rows' too. n: the sequence's tokens after the write. A page the step filled is final and was not
    staged, so its rows see it as the write made it: a verification's first row may have filled it, as its decode
    step did, but no drafted row does (verification_room); the rows of a short prefill chunk may."""
    ps, m = layer.page_size, k.shape[0]
    off = (m - 1) % ps
    if n >= m - 1 - off + ps:  # this row's page is full
        return k, v
    sides = []
    for x, stage, scale, zero, fmt in ((k, layer.k_stage, layer.k_scale, layer.k_zero, layer.k_format),
                                       (v, layer.v_stage, layer.v_scale, layer.v_zero, layer.v_format)):
        if fmt in PER_PAGE:
            vals = stage[slot - off:slot + 1].float()[None]  # the page's tokens up to this row's, as computed
            codes, s, z = _round_pages(vals, torch.ones(1, off + 1, 1, 1, dtype=torch.bool, device=vals.device),
                                       scale.dtype, zero.dtype)
            x = torch.cat([x[:m - off - 1], (codes[0] * s.float() + z.float()).to(x.dtype)])
        sides.append(x)
    return sides


def per_page(kv_dtype_formats: tuple[str, str]) -> bool:
    """Whether the keys or the values are in a per-page format (int4ch), whose open page is staged."""
    return any(f in PER_PAGE for f in kv_dtype_formats)


def verification_room(position: int, page_size: int, kv_dtype_formats: tuple[str, str]) -> int | None:
    """The most drafted rows a step may verify from position on (its first drafted token's), None for no bound:
    under a per-page format (int4ch) no drafted row may fill a page, which would round the whole page over the
    rows' keys where their decode steps saw it open (_as_decode_page rounds an open page again for each row)."""
    if not per_page(kv_dtype_formats):
        return None
    return (page_size - 1 - position % page_size) % page_size


def decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query row [Hq, D] over its keys and values [n, H, D] (its own the last): a decode step's attention. It
    sees every key, so it needs no mask, but for a window."""
    n = k.shape[0]
    mask = torch.ones(1, n, dtype=torch.bool, device=q.device).triu(diagonal=n - window) if 0 < window < n else None
    o = F.scaled_dot_product_attention(q[None, None].transpose(1, 2), k[None].transpose(1, 2),
                                       v[None].transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0, :, 0]


def rows_as_decode(kv_dtype_formats: tuple[str, str], device: torch.device) -> bool:
    """Whether a step's few rows of one sequence (a verification of drafted tokens) compute over pages of these
    formats what plain decoding computes, so that speculative decoding keeps its reply: float pages anywhere (the
    CPU's kernels bit for bit, a GPU's within float rounding); rounded ones on the CPU, where paged_attention_ref
    takes such rows one at a time (ROWS_AS_DECODE; the GPU's prefill kernel sums in another order than its decode
    kernel, which over rounded pages flips codes), a per-page format's (int4ch) open page rounded again for each
    row as its decode step rounded it (_as_decode_page; its drafts bounded by verification_room)."""
    return all(f in ("fp32", "fp16", "bf16") for f in kv_dtype_formats) or device.type == "cpu"


# The decode kernel's int8 and int4 values meet float16 softmax weights, and int4 keys float16 queries, where its
# dots are 16-bit (decode_kernel's HALF_VALUES): sm_90, Llama-3-8B heads, int8 pages 1466 -> 1252 loop
# instructions, 255 -> 175 registers, 64 -> 0 bytes spilled; int4 2146 -> 1864 (docs/PERF.md); int8's and fp8's values
# as byte pairs (paged_attention._byte_pairs) 1273 -> 934 and 1279 -> 1083, 187 -> 174 and 204 -> 141 registers.
# LOCALPD_HALF_VALUES=0 keeps them in the dots' type (a GPU's A/B).
HALF_VALUES = os.environ.get("LOCALPD_HALF_VALUES", "1") != "0"
KINDS = {"fp32": 0, "fp16": 0, "bf16": 0, "int8": 1, "fp8": 2, "int4": 3, "int4ch": 4}
BLOCK_M = 16  # query rows of each query head in a prefill program (GP x 16 rows with the group; tl.dot needs 16)
# A prefill program's warps: 4, and one more per 2048 elements of its [rows, head_dim] tiles past 8192. Its
# queries and accumulators take about 2 registers per element per thread; at 4 warps a Qwen2.5-7B program (a
# group of 7 padded to 8, 128 rows of 128) took all 255 registers and spilled up to 496 bytes (sm_90 code,
# Triton 3.9, scripts/compile_check.py).
PREFILL_TILE_ELEMS_PER_WARP = 2048


def kernel_head_dim(head_dim: int) -> bool:
    """Whether the kernels take heads of this size as they are: multiples of 32 (an int4 group) up to 256 (Gemma
    3), each in a tile of the power of two that covers it (Phi-3-mini's 96 in 128, the columns past 96 masked, so
    neither the KV cache nor a load holds padding). Others are padded (loader.pad_heads)."""
    return head_dim % 32 == 0 and 32 <= head_dim <= 256


def triton_supports(layer: KVLayer, head_dim: int) -> bool:
    """Heads kernel_head_dim takes, pages of 16 or 32 tokens."""
    return kernel_head_dim(head_dim) and layer.page_size in (16, 32)


def _strides(data: torch.Tensor, scale: torch.Tensor | None):
    """Page, token and head strides of one side's data, then of its scales (zeros share them)."""
    return (*data.stride()[:3], *(scale.stride()[:3] if scale is not None else (0, 0, 0)))


def _scales(layer: KVLayer):
    dummy = layer.k  # never read for formats without scales
    return tuple(dummy if t is None else t for t in (layer.k_scale, layer.v_scale, layer.k_zero, layer.v_zero))


def wide_offsets(layer: KVLayer) -> bool:
    """Whether the decode kernel computes offsets into the layer's pages in int64 (its WIDE): its keys' or values'
    last element lies 2**31 elements or more past their start (the offsets are counted in elements; the scales and
    zeros hold fewer elements than the codes they scale, in every format). Below that, int32 offsets keep 64-bit
    address arithmetic out of the decode loop (kernels/paged_attention._page_ids). Asked every decode step of every
    layer: a contiguous view (a pool's layer) is read from its size alone."""
    def last(t: torch.Tensor) -> int:
        if t.is_contiguous():
            return t.numel() - 1
        return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))

    return max(last(layer.k), last(layer.v)) > 2**31 - 1


def _stage_args(stage, stage_slots, dummy):
    """(stage, its token and head strides, whether the write reads it) for a kernel; dummy where none is used."""
    if stage is None or stage_slots is None:
        return dummy, 0, 0, False
    return stage, stage.stride(0), stage.stride(1), True


def rope_write_warps(layer: KVLayer, head_dim: int) -> int:
    """One warp a (token, head) program; four for an int4ch page rewrite of heads of 256, whose [page, 128] tiles
    spilled 352-744 bytes of registers at one warp (sm_86/90, scripts/compile_check.py), and of heads that do not
    fill their tile (96 in 128: the masks took 255 registers and spilled 208-216 bytes on sm_90 at one warp)."""
    wide = head_dim > 128 or head_dim != triton_block(head_dim)
    return 4 if wide and "int4ch" in (layer.k_format, layer.v_format) else 1


def prefill_block_m(head_dim: int, group_padded: int) -> int:
    """Query rows of each head in a prefill program: BLOCK_M; for heads of 256 as many as make 16 rows with the
    group (at least 4): 32 or 64 rows of 256 spilled up to 312 bytes of registers on sm_90 even at 8 or 16 warps."""
    return BLOCK_M if head_dim <= 128 else max(16 // group_padded, 4)


def write_kv(layer: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             stage_slots: torch.Tensor | None = None) -> None:
    """In place: k, v [T, H, D] into their slots, quantized to the layer's formats (stage_slots: write_kv_ref)."""
    if not (use_triton(k) and triton_supports(layer, k.shape[-1])):
        return write_kv_ref(layer, k, v, slots, stage_slots)
    from localpd.kernels.paged_attention import write_kv_kernel

    T, H, D = k.shape
    for x, (data, scale, zero, fmt), stage in zip((k, v), _sides(layer), (layer.k_stage, layer.v_stage)):
        # fp8 pages are written by torch: Triton's interpreter converts some values to e4m3 wrongly, so a Triton
        # fp8 write could not be checked here (reading fp8 in the attention kernels is checked)
        if fmt == "fp8":
            _write_side_ref(x, data, scale, zero, fmt, slots, layer.page_size)
            continue
        x = x if x.stride(-1) == 1 else x.contiguous()  # token and head strides are the kernel's arguments
        dummy = data  # never read for formats without scales, zeros or a stage
        st, st_t, st_h, staged = _stage_args(stage, stage_slots, dummy)
        write_kv_kernel[(T, H)](x, slots, data, dummy if scale is None else scale, dummy if zero is None else zero,
                                st, slots if stage_slots is None else stage_slots, T, x.stride(0), x.stride(1),
                                *_strides(data, scale), st_t, st_h, KIND=KINDS[fmt], PS=layer.page_size, D=D,
                                DP=triton_block(D), STAGED=staged)


def rope_write_kv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: KVLayer, slots: torch.Tensor,
                      n_heads: int, n_kv_heads: int, stage_slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (n_heads + 2 * n_kv_heads) * D], one projection's output: rotates the query heads in place, writes
    the key heads rotated and the value heads into their slots; returns the query heads [T, n_heads, D] (a view).
    The key heads left in qkv are unspecified (the Triton kernel leaves them unrotated)."""
    T, D = qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    heads = qkv.view(T, -1, D)
    rope(heads[:, :n_heads + n_kv_heads], cos, sin)
    write_kv(layer, heads[:, n_heads:n_heads + n_kv_heads], heads[:, n_heads + n_kv_heads:], slots, stage_slots)
    return heads[:, :n_heads]


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: KVLayer, slots: torch.Tensor,
                  n_heads: int, n_kv_heads: int, stage_slots: torch.Tensor | None = None) -> torch.Tensor:
    """rope_write_kv_ref in one kernel launch (where three would run: RoPE, the key write, the value write)."""
    T = qkv.shape[0]
    D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    if not use_triton(qkv) and cpu.takes_rope_write(qkv, cos, sin, layer, stage_slots):
        return cpu.rope_write(qkv, cos, sin, layer, slots, n_heads, n_kv_heads, stage_slots)
    if (not (use_triton(qkv) and triton_supports(layer, D)) or qkv.stride(-1) != 1 or cos.stride(-1) != 1
            or "fp8" in (layer.k_format, layer.v_format)):  # fp8 pages are written by torch (see write_kv)
        return rope_write_kv_ref(qkv, cos, sin, layer, slots, n_heads, n_kv_heads, stage_slots)
    from localpd.kernels.paged_attention import rope_write_kv_kernel
    from localpd.kernels.pdl import launch_args

    if T:
        ks, ks_t, ks_h, k_staged = _stage_args(layer.k_stage, stage_slots, layer.k)
        vs, vs_t, vs_h, v_staged = _stage_args(layer.v_stage, stage_slots, layer.v)
        rope_write_kv_kernel[(T, n_heads + 2 * n_kv_heads)](
            qkv, cos, sin, slots, layer.k, layer.v, *_scales(layer), ks, vs,
            slots if stage_slots is None else stage_slots, qkv.stride(0), cos.stride(0),
            *_strides(layer.k, layer.k_scale), *_strides(layer.v, layer.v_scale), ks_t, ks_h, vs_t, vs_h,
            n_heads, n_kv_heads, T, K_KIND=KINDS[layer.k_format], V_KIND=KINDS[layer.v_format],
            PS=layer.page_size, D=D, DP=triton_block(D), K_STAGED=k_staged, V_STAGED=v_staged,
            num_warps=rope_write_warps(layer, D), **launch_args(qkv))
    return qkv.view(T, -1, D)[:, :n_heads]


# Decode attention walks each split a tile at a time, BLOCK_T tokens spanning BLOCK_T // page_size pages: one page
# (16 tokens) per iteration left too few bytes in flight per SM (H100, 2026-11-23: 18% of bandwidth at 32k). A tile
# is DECODE_TILE_ELEMS elements of K (and as many of V): 64 tokens at head dim 128, 128 at 64, 16 KB of bf16 a trip;
# over int8, fp8 and int4 keys (DECODE_WIDE_TILE_KEYS) twice the tokens, the same 16 KB of int8. Always whole pages.
# The query group is padded to 16 rows for tl.dot. Measured on an H100 at 32k tokens (scripts/sweep_decode_attention.py,
# 2026-11-26): bf16 best at 8192 (16384: 1.0x, 32768: 0.66x); int8 and int4 1.25x faster at 16384 than at 8192,
# slower again at 32768; 2 programs an SM and 4 warps best or within 3%. int4ch keys keep 8192: at 16384 their sm_90
# code spills 72 bytes (unmeasured there); int8's spills 64 (Triton 3.9) and was the measured 1.25x.
DECODE_TILE_ELEMS = 8192
DECODE_WIDE_TILE_KEYS = ("int8", "fp8", "int4")
# At most, over int8 and fp8 keys: at heads of 64 their 256-token tiles took 255 registers, spilled 24-72 bytes (4-15
# local accesses a trip) and waited a DRAM round trip every trip (sm_90, Triton 3.9); 128 took 140-155, none of either
DECODE_8BIT_TILE_TOKENS = 128
DECODE_WARPS = 4
DECODE_PROGRAMS_PER_SM = 2  # what the splits aim at when batch x kv heads alone leave SMs idle
DECODE_MAX_SPLITS = 64  # the reduce holds all of a head's splits in one [splits, head_dim] tile
INTERPRETER_DECODE_PROGRAMS = 4  # the splits' target under Triton's interpreter (no SMs to fill)


def decode_block_t(page_size: int, head_dim: int, k_format: str = "bf16") -> int:
    """Tokens per decode tile over keys of k_format: DECODE_TILE_ELEMS elements of the head's tile width (twice as
    many for DECODE_WIDE_TILE_KEYS, at most DECODE_8BIT_TILE_TOKENS over int8 and fp8), and at least one page."""
    tokens = DECODE_TILE_ELEMS * (2 if k_format in DECODE_WIDE_TILE_KEYS else 1) // triton_block(head_dim)
    if k_format in ("int8", "fp8"):
        tokens = min(tokens, DECODE_8BIT_TILE_TOKENS)
    return max(page_size, tokens)


def decode_splits(batch_heads: int, tiles: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split) of `tiles` tiles, the page table's (flash-decoding): about DECODE_PROGRAMS_PER_SM
    programs per SM at long contexts, but no split shorter than a tile (short contexts get few) and no split that
    every sequence leaves empty. The decode kernel shares each sequence's own tiles out over the splits."""
    target = DECODE_PROGRAMS_PER_SM * sm_count(device) if device.type == "cuda" else INTERPRETER_DECODE_PROGRAMS
    return splits_for(batch_heads, tiles, target)


def splits_for(batch_heads: int, tiles: int, programs: int) -> tuple[int, int]:
    """decode_splits' (splits, tiles per split) for a launch that aims at `programs` programs."""
    per = cdiv(tiles, max(1, min(tiles, cdiv(programs, batch_heads), DECODE_MAX_SPLITS)))
    return cdiv(tiles, per), per


def decode_span(table_tokens: int, window: int, page_size: int) -> int:
    """Tokens a decode's splits share out: the page table's, or a sliding layer's window counted from the start of
    the page it begins in (most of a long context's splits would otherwise lie before the window, empty)."""
    return min(table_tokens, window + page_size - 1) if window > 0 else table_tokens


def attention_dot(dtype: torch.dtype, interpreted: bool):
    """The attention kernels' dot operand type for queries of `dtype`: bfloat16/float16 queries take their own
    type, which holds every stored key and value exactly (bf16/fp16 pages, int8 codes, fp8 values; int4's
    dequantized values rounded once), the softmax weights rounded to it as FlashAttention does: tensor-core dots at
    twice tf32's rate, from tiles of half the registers. float32 queries keep float32 (tf32 on a GPU). Triton's
    interpreter multiplies bfloat16 dots wrongly (an error of 4.5e10 on a 16 x 32 product, Triton 3.9), so there
    bfloat16 takes float32; its float16 dots are right and run as a GPU's do."""
    import triton.language as tl

    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreted:
        return tl.bfloat16
    return tl.float32


def prefill_value_pairs(arch: int) -> bool:
    """Whether the prefill kernel loads int8 and fp8 values as byte pairs (its PAIRS; paged_attention._byte_pairs)
    on an NVIDIA card of compute capability `arch` (86 for sm_86; 0 under Triton's interpreter, which takes them
    too, so that its tests run the path). Before sm_90 its 64-row programs take mma.sync, whose values' operand
    read 8-bit values from shared memory a byte at a time: byte pairs cut a page's instructions 974 -> 697 (int8)
    and 896 -> 616 (fp8) on sm_86/sm_89, Llama-3-8B heads; on sm_90 they cost 452 -> 469 and 403 -> 448."""
    return arch < 90


def int8_key_dots(layer: KVLayer, dtype: torch.dtype) -> bool:
    """Whether decode scores int8 keys by integer dots (tensor cores' int8 rate, keys as stored): with half-precision
    queries, each query head rounded to two int8 levels (about 15 bits, more than bfloat16's 8). Where keys were
    converted to the dot's type first, int8 pages took as many conversions as bytes and ran at 0.84x bf16 pages'
    speed at 32k tokens (H200, docs/PERF.md); float32 queries keep their precision."""
    return layer.k_format == "int8" and dtype in (torch.float16, torch.bfloat16)


def rounds_output(q: torch.Tensor, layer: KVLayer, seq_lens: torch.Tensor) -> bool:
    """Whether paged_attention takes round_into for these queries: its Triton decode step (every sequence one query
    row), heads a multiple of 32 wide (whole blocks of the rounding)."""
    T, _, D = q.shape
    return use_triton(q) and triton_supports(layer, D) and T == seq_lens.shape[0] and D % 32 == 0


def paged_attention(q: torch.Tensor, layer: KVLayer, page_table: torch.Tensor, seq_lens: torch.Tensor,
                    q_starts: torch.Tensor, scale: float, window: int = 0, round_into=None,
                    stage_slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] (see the module docstring); window > 0: a sliding-window layer's attention, each
    query over its last `window` keys. Decode kernel when every sequence has one query row (T == B, known without
    reading the device), else the prefill kernel. round_into (kernels/act_round.Rounded for T rows of Hq * D,
    where rounds_output): the decode reduce also rounds the output for the o projection's integer GEMV into it.
    stage_slots: the step's tokens' stage slots (per-page formats), for paged_attention_ref's verification rows."""
    T, Hq, D = q.shape
    assert round_into is None or rounds_output(q, layer, seq_lens)
    DP = triton_block(D)
    if not use_triton(q) and cpu.takes_attention(q, layer):
        return cpu.attention(q, layer, page_table, seq_lens, q_starts, scale, window, stage_slots)
    if not (use_triton(q) and triton_supports(layer, D)):
        return paged_attention_ref(q, layer, page_table, seq_lens, q_starts, scale, window, stage_slots)
    from localpd.kernels.paged_attention import decode_kernel, decode_reduce_kernel, prefill_kernel
    from localpd.kernels.pdl import launch_args

    pdl = launch_args(q)  # the decode kernel's and its reduce's
    B, H = seq_lens.shape[0], layer.k.shape[2]
    group = Hq // H
    out = torch.empty_like(q)
    ks, vs, kz, vz = _scales(layer)
    kinds = dict(K_KIND=KINDS[layer.k_format], V_KIND=KINDS[layer.v_format],
                 DOT=attention_dot(q.dtype, interpreted=not q.is_cuda))
    strides = (*_strides(layer.k, layer.k_scale), *_strides(layer.v, layer.v_scale))
    if T == B:
        ps = layer.page_size
        block_t = decode_block_t(ps, D, layer.k_format)
        span = decode_span(page_table.shape[1] * ps, window, ps)
        splits, _ = decode_splits(B * H, cdiv(span, block_t), q.device)  # the kernel shares out each length
        gp = max(16, 1 << (group - 1).bit_length())  # the group padded for tl.dot
        part_acc = torch.empty(B * Hq * splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * Hq * splits, 2, dtype=torch.float32, device=q.device)
        decode_kernel[(B, H, splits)](q, layer.k, layer.v, ks, vs, kz, vz, page_table, seq_lens, part_acc, part_ml,
                                      scale, q.stride(0), q.stride(1), page_table.stride(0), *strides,
                                      splits, window, **kinds, PS=ps, D=D, DP=DP,
                                      GROUP=group, GP=gp, BLOCK_T=block_t, num_warps=DECODE_WARPS,
                                      INT8_KEYS=int8_key_dots(layer, q.dtype), HALF_VALUES=HALF_VALUES,
                                      WIDE=wide_offsets(layer), **pdl)
        r = round_into
        decode_reduce_kernel[(B, Hq)](part_acc, part_ml, out, out.stride(0), out.stride(1), splits,
                                      *((r.q, r.s, r.q.stride(0), r.s.stride(0)) if r else (out, out, 0, 0)), D=D,
                                      DP=DP, SP=1 << (splits - 1).bit_length(), ROUND_BITS=r.bits if r else 0,
                                      num_warps=4, enable_fp_fusion=r is None, **pdl)  # rounded as quantize_act
        return out
    gp = 1 << (group - 1).bit_length()
    block_m = prefill_block_m(D, gp)
    prefill_kernel[(B, cdiv(T, block_m), H)](q, layer.k, layer.v, ks, vs, kz, vz, page_table, seq_lens, q_starts,
                                             out, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                             page_table.stride(0), *strides, window, **kinds, PS=layer.page_size, D=D,
                                             DP=DP, GROUP=group, GP=gp, BLOCK_M=block_m, HALF_VALUES=HALF_VALUES,
                                             WIDE=wide_offsets(layer), PAIRS=prefill_value_pairs(device_arch(q.device)),
                                             num_warps=max(4, gp * block_m * DP // PREFILL_TILE_ELEMS_PER_WARP))
    return out
