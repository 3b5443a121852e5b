"""Paged KV-cache storage: every layer's keys and values in fixed-size pages, stored as is or quantized.

Formats (per token and kv head, along head_dim):
- fp32 / fp16 / bf16: the values themselves, no scales.
- int8: symmetric, one scale per (token, head) = amax / 127.
- fp8: float8 e4m3 with one scale per (token, head) = amax / 448 (the format's largest normal value).
- int4: asymmetric groups of 32 along head_dim, scale = (max - min) / 15 and zero = min per group; two values per
  byte, element 2i in the low nibble and 2i + 1 in the high nibble.
- int4ch (keys): int4 per channel across a page's tokens (KIVI): each page holds one scale and one zero per head
  and channel, over the tokens written to it so far. A write re-quantizes the page's earlier tokens with the
  widened range (dispatch._write_pages_ref). Keys carry a few large channels that per-token groups cannot fit.
  So that a page filled a token at a time (decode) ends up exactly as one written whole (prefill), the pool keeps
  each running sequence's open page as computed, in a stage of a page per sequence (KVPool.k_stage, rows handed out
  by the scheduler): a write re-quantizes the page from the staged values instead of its already rounded codes.
Scales and zeros are float16: they are read every decode step, so they are kept small.

Keys and values may take different formats, written K/V: "int8/int4" keeps keys at int8 and values at int4
(llama.cpp's -ctk q8_0 -ctv q4_0). On SmolLM2-135M int4 keys alone cost +11.4% perplexity and int4 values +0.7%,
so this pair holds most of int4's saving over int8 at little of its loss. "int4ch/int4" stores keys per channel
instead: +1.1% in 7,920 bytes per token where int8/int4 takes 9,540 (docs/PERF.md). A single name is both.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError

FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "fp8", "int4ch")  # what keys or values can be stored as
KV_DTYPES = (*FORMATS[:-1], "int8/int4", "int4ch/int4")  # offered and benchmarked; any K/V pair of FORMATS is accepted
PER_PAGE = ("int4ch",)  # formats whose scales and zeros belong to a page, not to a token
FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT4_GROUP = 32
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16


@dataclass
class KVLayer:
    """One layer's pages: views [n_pages, page_size, n_kv_heads, ...] into a KVPool. kv_dtype names the formats
    of both (see kv_formats); k_format and v_format are each one."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_zero: torch.Tensor | None
    kv_dtype: str
    page_size: int
    compute_dtype: torch.dtype
    k_stage: torch.Tensor | None = None  # per-page formats: [stage_rows * page_size, n_kv_heads, head_dim]
    v_stage: torch.Tensor | None = None

    @property
    def k_format(self) -> str:
        return kv_formats(self.kv_dtype)[0]

    @property
    def v_format(self) -> str:
        return kv_formats(self.kv_dtype)[1]


@dataclass
class KVPool:
    """All layers' paged keys and values. Page p holds tokens [p * page_size, (p + 1) * page_size) of whatever
    sequence owns it (localpd.kvcache.pages decides who)."""

    kv_dtype: str
    page_size: int
    k: torch.Tensor  # [n_layers, n_pages, page_size, n_kv_heads, packed_dim], storage dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [n_layers, n_pages, page_size, n_kv_heads, n_groups] float16
    v_scale: torch.Tensor | None
    k_zero: torch.Tensor | None  # int4 only
    v_zero: torch.Tensor | None
    compute_dtype: torch.dtype
    # per-page formats: each running sequence's open page as computed, [n_layers, stage_rows * page_size,
    # n_kv_heads, head_dim] in the compute dtype; row r holds slots r * page_size .. (r + 1) * page_size - 1
    k_stage: torch.Tensor | None = None
    v_stage: torch.Tensor | None = None

    def layer(self, i: int) -> KVLayer:
        """Layer i's views. A per-page format's scales and zeros ([n_pages, 1, heads, head_dim] each) are seen as
        [n_pages, page_size, heads, head_dim] with a token stride of 0, so that every reader indexes them per
        token like any other format's."""
        def pick(t):
            return None if t is None else t[i].expand(-1, self.page_size, -1, -1)

        def stage(t):
            return None if t is None else t[i]

        return KVLayer(self.k[i], self.v[i], pick(self.k_scale), pick(self.v_scale), pick(self.k_zero),
                       pick(self.v_zero), self.kv_dtype, self.page_size, self.compute_dtype, stage(self.k_stage),
                       stage(self.v_stage))

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    @property
    def has_stage(self) -> bool:
        """Whether a side is in a per-page format, so that writes take stage slots."""
        return self.k_stage is not None or self.v_stage is not None

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4] * (2 if self.k.dtype == torch.uint8 else 1)  # uint8: two int4 values a byte

    def bytes_per_token(self) -> int:
        """Storage bytes of one token's keys and values over all layers, scales and zeros included."""
        tensors = [t for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_zero, self.v_zero) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) // (self.n_pages * self.page_size)


def same_kv(dtype: torch.dtype) -> str:
    """The KV format that stores values as they are computed in dtype: torch.bfloat16 -> "bf16"."""
    return next(name for name, d in FLOAT.items() if d == dtype)


def has_fp8(device) -> bool:
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return True  # the CPU converts in software


@functools.lru_cache(maxsize=None)  # every step's accounting (KVTraffic) asks
def kv_formats(kv_dtype: str) -> tuple[str, str]:
    """(key format, value format) of a KV dtype: "int8/int4" -> ("int8", "int4"), "bf16" -> ("bf16", "bf16")."""
    parts = tuple(kv_dtype.split("/"))
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in FORMATS for p in parts):
        raise LocalpdError(f"unknown KV dtype '{kv_dtype}'; choose one of {', '.join(FORMATS)}, or a pair for keys "
                           f"and values such as int8/int4")
    return parts


def check_kv_dtype(kv_dtype: str, device) -> str:
    k_format, v_format = kv_formats(kv_dtype)
    if k_format == v_format:
        kv_dtype = k_format  # int8/int8 is int8
    if "fp8" in (k_format, v_format) and not has_fp8(device):
        raise LocalpdError("--kv fp8 needs float8 e4m3 support (an sm_89 or newer GPU, torch >= 2.1); "
                           "use int8 instead")
    return kv_dtype


def _layout(fmt: str, head_dim: int) -> tuple[torch.dtype, int, int, bool]:
    """(storage dtype, packed dim, scale groups, has zeros) of a format."""
    if fmt in FLOAT:
        return FLOAT[fmt], head_dim, 0, False
    if fmt == "int8":
        return torch.int8, head_dim, 1, False
    if fmt == "fp8":
        return torch.float8_e4m3fn, head_dim, 1, False
    if head_dim % INT4_GROUP:
        raise LocalpdError(f"--kv {fmt} needs a head dimension divisible by {INT4_GROUP}, this model has {head_dim}")
    return torch.uint8, head_dim // 2, head_dim if fmt in PER_PAGE else head_dim // INT4_GROUP, True


@functools.lru_cache(maxsize=None)
def _head_bytes(fmt: str, head_dim: int) -> tuple[int, int]:
    """(code bytes, scale and zero bytes) of one token's head in a format; a per-page format's scales and zeros
    are those of a whole page's head."""
    storage, packed, groups, zeros = _layout(fmt, head_dim)
    return packed * storage.itemsize, groups * SCALE_DTYPE.itemsize * (2 if zeros else 1)


def kv_bytes_per_token(kv_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int, page_size: int = 16) -> int:
    """What bytes_per_token() of a pool would say, without allocating one (a page's scales shared by its tokens)."""
    per_head = 0
    for fmt in kv_formats(kv_dtype):
        codes, scales = _head_bytes(fmt, head_dim)
        per_head += codes + (scales // page_size if fmt in PER_PAGE else scales)
    return n_layers * n_kv_heads * per_head


@dataclass(frozen=True)
class KVTraffic:
    """Bytes a step moves in a KV cache of this format and shape (localpd.measure.roofline counts them). Per-token
    formats read and write each token's codes and scales. A per-page format (int4ch) reads a page's scales and zeros
    once however few of its tokens are attended, and its write re-quantizes every page it touches whole, as the
    write kernel does: it reads the page's earlier tokens from the stage, writes the codes of every token up to
    the last new one and the page's scales and zeros, and stages the new tokens of a page it leaves open."""

    kv_dtype: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 16
    stage_itemsize: int = 4  # the compute dtype's: a per-page format stages tokens as computed
    sliding_layers: int = 0  # layers whose queries see only their last `window` keys (Gemma 3: five in six)
    window: int = 0

    @property
    def per_token(self) -> int:
        """Storage bytes of a token, a page's scales shared by its tokens (what sizes the pool)."""
        return kv_bytes_per_token(self.kv_dtype, self.n_layers, self.n_kv_heads, self.head_dim, self.page_size)

    def read(self, tokens: int, new: int = 1) -> int:
        """Bytes of one sequence's first `tokens` keys and values, as attention reads them for its last `new`
        tokens' queries: every key in a global layer, the keys from the first query's window on in a sliding one
        (a per-page format's scales for each page touched)."""
        sliding = min(self.sliding_layers, self.n_layers) if self.window else 0
        seen = min(tokens, self.window + new - 1) if sliding else tokens
        pages = (-(-tokens // self.page_size), -(-tokens // self.page_size) - (tokens - seen) // self.page_size)
        total = 0
        for layers, n, p in ((self.n_layers - sliding, tokens, pages[0]), (sliding, seen, pages[1])):
            for fmt in kv_formats(self.kv_dtype):
                codes, scales = _head_bytes(fmt, self.head_dim)
                total += layers * (codes * n + (scales * p if fmt in PER_PAGE else scales * n))
        return self.n_kv_heads * total

    def written(self, start: int, n: int) -> int:
        """Bytes of one sequence's write of its tokens start .. start + n - 1 (n >= 0)."""
        if n <= 0:
            return 0
        ps, staged = self.page_size, self.head_dim * self.stage_itemsize
        per_head = 0
        for fmt in kv_formats(self.kv_dtype):
            codes, scales = _head_bytes(fmt, self.head_dim)
            if fmt not in PER_PAGE:
                per_head += (codes + scales) * n
                continue
            for page in range(start // ps, (start + n - 1) // ps + 1):
                first = max(start - page * ps, 0)  # the page's first new offset: earlier ones are read back
                last = min(start + n - page * ps, ps) - 1
                per_head += first * staged + (last + 1) * codes + scales
                if last < ps - 1:  # left open: its new tokens are staged
                    per_head += (last - first + 1) * staged
        return self.n_layers * self.n_kv_heads * per_head


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on the CPU over fresh anonymous memory, which the OS hands out already zeroed, a page at a
    time as it is first touched: a pool sized for two full contexts costs nothing up front (zero-filling it took
    up to 2 s at start-up), and only the pages written stay resident."""
    n = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE), dtype=torch.uint8).view(dtype).view(shape)


def new_kv_pool(kv_dtype: str, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                compute_dtype: torch.dtype, device, stage_rows: int = 1) -> KVPool:
    """stage_rows: how many sequences may have an open page at once (the scheduler's running sequences), for the
    per-page formats' stage. Every page starts zeroed (lazy_zeros)."""
    base = (n_layers, n_pages, page_size, n_kv_heads)

    def side(fmt):  # (data, scale, zero) of keys or values in their format
        storage, packed, groups, zeros = _layout(fmt, head_dim)
        data = lazy_zeros(base + (packed,), storage, device)
        scale_shape = (n_layers, n_pages, 1, n_kv_heads, groups) if fmt in PER_PAGE else base + (groups,)
        scale = lazy_zeros(scale_shape, SCALE_DTYPE, device) if groups else None
        return data, scale, lazy_zeros(scale_shape, SCALE_DTYPE, device) if zeros else None

    def stage(fmt):
        if fmt not in PER_PAGE:
            return None
        return lazy_zeros((n_layers, stage_rows * page_size, n_kv_heads, head_dim), compute_dtype, device)

    (k, ks, kz), (v, vs, vz) = (side(fmt) for fmt in kv_formats(kv_dtype))
    k_stage, v_stage = (stage(fmt) for fmt in kv_formats(kv_dtype))
    return KVPool(kv_dtype, page_size, k, v, ks, vs, kz, vz, compute_dtype, k_stage, v_stage)


def quantize_kv(x: torch.Tensor, fmt: str):
    """x [..., head_dim] -> (data, scale, zero) in the storage format (scale/zero None where the format has none)."""
    if fmt in FLOAT:
        return x.to(FLOAT[fmt]), None, None
    if fmt in PER_PAGE:
        raise ValueError(f"{fmt} is quantized a page at a time (kvcache.dispatch.write_kv_ref)")
    xf = x.float()
    if fmt in ("int8", "fp8"):
        top = 127.0 if fmt == "int8" else FP8_MAX
        scale = (xf.abs().amax(-1, keepdim=True) / top).to(SCALE_DTYPE)
        s = scale.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        y = xf / safe
        if fmt == "int8":
            data = y.round().clamp(-127, 127).to(torch.int8)
        else:
            data = y.clamp(-top, top).to(torch.float8_e4m3fn)
        return data, scale, None
    g = xf.unflatten(-1, (-1, INT4_GROUP))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    s = scale.float()[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = ((g - zero.float()[..., None]) / safe).round().clamp(0, 15).to(torch.uint8).flatten(-2)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale, zero


def dequantize_kv(data: torch.Tensor, scale, zero, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_kv, in dtype; [..., packed] -> [..., head_dim]."""
    if fmt in FLOAT:
        return data.to(dtype)
    if fmt in ("int8", "fp8"):
        return (data.float() * scale.float()).to(dtype)
    q = torch.stack((data & 15, data >> 4), dim=-1).flatten(-2).float()
    if fmt in PER_PAGE:  # scale and zero per channel
        return (q * scale.float() + zero.float()).to(dtype)
    g = q.unflatten(-1, (-1, INT4_GROUP))
    return (g * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(dtype)
