"""Weight-only quantized formats as plain data: int8 (symmetric) and int4 (group-wise, scale + bias).

A weight W has shape [N, K] (N outputs, K inputs) and is used as y = x @ W.T. Groups run along K.

Int4 packed layout (what the GPU kernels read)
----------------------------------------------
`packed` is int32 [N, K // 8]. Word j of row n holds columns 8j .. 8j+7, column 8j + s in bits 4s .. 4s+3
(nibble s, least significant first). Seen as bytes (little-endian), byte b of a row holds column 2b in its
low nibble and column 2b + 1 in its high nibble, so `packed.view(torch.uint8)` is the plain [N, K // 2]
layout. Four consecutive words (one 16-byte load) hold 32 consecutive columns.
The value of column k is q * scales[n, k // group] + biases[n, k // group], with q in 0..15.

Integer zero points
-------------------
GPTQ, AWQ and compressed-tensors store asymmetric int4 as (q - z) * scale with an integer zero point z in 0..15.
An Int4Weight holds such a group exactly when its bias is -z * scale (integer_zeros finds z). quantize(...,
integer_zero=True) makes every group so: its float16 scale has at most 7 significant bits (integer_zero_scale), so
z * scale (at most 11) is a float16 and the bias is stored exactly; q * scale + bias is then (q - z) * scale to the
last bit in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError
from localpd.load.gguf_header import GGML_TYPES
from localpd.quant import gguf_blocks
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight
from localpd.quant.codebook import CODEBOOK_TYPES

INT4_GROUPS = (32, 64, 128)
ZERO_SCALE_BITS = 7  # significant bits of an integer-zero-point scale: 7 + 4 (z <= 15) fit float16's 11
CLIP_RATIOS = torch.linspace(1.0, 0.8, 20).tolist()  # 1.0 first: plain min/max round-to-nearest
_CHUNK_ELEMENTS = 1 << 23  # rows quantized at a time, to bound temporary memory


def _check_group(kind: str, group: int, k: int) -> None:
    if group <= 0 or k % group:
        raise LocalpdError(f"{kind}-g{group} needs the input dimension ({k}) to be a multiple of {group}")


def check_fields(kind: str, w, want: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Each named tensor of weight w has its (dtype, shape) in want, else a one-line error naming it."""
    n, k = w.shape
    for name, (dtype, shape) in want.items():
        t = getattr(w, name)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise LocalpdError(f"{kind} {name} must be {dtype} {shape} for a {n}x{k} weight, got {t.dtype} "
                               f"{tuple(t.shape)}")


def _row_chunks(w: torch.Tensor):
    rows = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1]))
    for start in range(0, w.shape[0], rows):
        yield w[start:start + rows]


@dataclass
class Int8Weight:
    """Symmetric int8: value = data * scales[n, k // group]. group = K means one scale per output row."""

    data: torch.Tensor    # int8 [N, K]
    scales: torch.Tensor  # float16 [N, K // group]

    def __post_init__(self):
        if self.data.dtype != torch.int8 or self.data.dim() != 2:
            raise LocalpdError(f"int8 weight data must be a 2-D int8 tensor, got {self.data.dtype} {tuple(self.data.shape)}")
        n, k = self.data.shape
        if self.scales.dim() != 2 or self.scales.shape[0] != n or self.scales.shape[1] == 0 or k % self.scales.shape[1]:
            raise LocalpdError(f"int8 scales of shape {tuple(self.scales.shape)} do not fit weight data {n}x{k}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def group(self) -> int:
        return self.data.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int | None = None) -> Int8Weight:
        """Round-to-nearest with scale = absmax / 127 per group (per output row when group is None)."""
        n, k = w.shape
        group = k if group is None else group
        _check_group("int8", group, k)
        g = w.detach().float().reshape(n, k // group, group)
        scales = (g.abs().amax(dim=-1) / 127).half()
        safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
        q = torch.round(g / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k).contiguous(), scales.contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.data.float().reshape(n, k // self.group, self.group) * self.scales.float()[..., None]
        return g.reshape(n, k).to(dtype)


@dataclass
class Int4Weight:
    """Group-wise asymmetric int4: value = q * scale + bias per group of `group` columns, q in 0..15."""

    packed: torch.Tensor  # int32 [N, K // 8], layout in the module docstring
    scales: torch.Tensor  # float16 [N, K // group]
    biases: torch.Tensor  # float16 [N, K // group]
    SYMMETRIC_BIAS = -8  # a symmetric weight's bias, times its scale (Q4_0's): symmetric()

    def __post_init__(self):
        if self.packed.dtype != torch.int32 or self.packed.dim() != 2:
            raise LocalpdError(f"int4 packed weights must be a 2-D int32 tensor, got {self.packed.dtype} {tuple(self.packed.shape)}")
        n, k = self.shape
        for name, t in (("scales", self.scales), ("biases", self.biases)):
            if t.dim() != 2 or t.shape[0] != n or t.shape[1] == 0 or k % t.shape[1]:
                raise LocalpdError(f"int4 {name} of shape {tuple(t.shape)} do not fit a {n}x{k} weight")
        if self.scales.shape != self.biases.shape:
            raise LocalpdError("int4 scales and biases must have the same shape")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases)) - cpu_biases_skipped(self)

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = 128, importance: torch.Tensor | None = None,
                 integer_zero: bool = False) -> Int4Weight:
        """Per group, try clipping ratios r of [min, max] and keep the one with least squared error, then refine
        scale and bias by alternating least squares (_refit_int4; with integer_zero, _refit_int4_zero: the bias
        stays -z * scale for an integer zero point z, module docstring).

        Scale and bias are rounded to float16 before the error is measured, so the choice is made on what
        is stored. Ratio 1.0 is tried first, so the result is never worse than plain round-to-nearest.
        importance: optional non-negative weights per input column [K] (the mean square of the activations that
        meet that column, localpd.quantize.calibrate), so the error is measured where the activations make it count:
        sum_k importance[k] * (w[n, k] - w_hat[n, k])^2 (llama.cpp's importance matrix does the same).
        """
        n, k = w.shape
        if group not in INT4_GROUPS:
            raise LocalpdError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
        _check_group("int4", group, k)
        h = None
        if importance is not None:
            if importance.shape != (k,):
                raise LocalpdError(f"importance must have one value per input column ({k}), got {tuple(importance.shape)}")
            h = importance.detach().float().to(w.device).clamp_min(0).reshape(1, k // group, group)
            h = h + 1e-3 * h.mean()  # columns never seen active still count a little
        rows_of = _quantize_int4_zero_rows if integer_zero else _quantize_int4_rows
        parts = [rows_of(rows.detach().float(), group, h=h) for rows in _row_chunks(w)]
        q = torch.cat([p[0] for p in parts])
        return cls(pack_int4(q), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))

    @classmethod
    def quantize_rtn(cls, w: torch.Tensor, group: int = 128, integer_zero: bool = False) -> Int4Weight:
        """Plain min/max round-to-nearest (no clipping search, no refit): the baseline `quantize` improves on."""
        n, k = w.shape
        _check_group("int4", group, k)
        rows_of = _quantize_int4_zero_rows if integer_zero else _quantize_int4_rows
        q, scales, biases = rows_of(w.detach().float(), group, ratios=(1.0,))
        return cls(pack_int4(q), scales, biases)

    def unpack(self) -> torch.Tensor:
        """The 4-bit codes q as uint8 [N, K]."""
        return unpack_int4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.unpack().float().reshape(n, k // self.group, self.group)
        g = q * self.scales.float()[..., None] + self.biases.float()[..., None]
        return g.reshape(n, k).to(dtype)


def _quantize_int4_rows(w: torch.Tensor, group: int, ratios=CLIP_RATIOS, h: torch.Tensor | None = None):
    """Codes, scales and biases of rows w; h: error weights per column as [1, K // group, group], or None (all
    ones: the same sums, without multiplying by them)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    wmin, wmax = g.amin(dim=-1), g.amax(dim=-1)
    best_err = best_s = best_b = None
    for r in ratios:
        scales = ((wmax - wmin) * r / 15).half()
        biases = (wmin * r).half()
        err = _int4_error(g, h, _int4_codes(g, scales, biases), scales, biases)
        if best_err is None:
            best_err, best_s, best_b = err, scales, biases
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scales, best_s)
        best_b = torch.where(better, biases, best_b)
    best_q = _int4_codes(g, best_s, best_b)  # a group's codes follow from its scale and bias: rounded once, here
    if len(ratios) > 1:
        best_q, best_s, best_b = _refit_int4(g, h, best_q, best_s, best_b, best_err)
    return best_q.to(torch.uint8).reshape(n, k), best_s.contiguous(), best_b.contiguous()


def _int4_codes(g: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Float codes 0..15 of groups g [..., group] for float16 scales and biases [...]: round((g - b) / s)."""
    s, b = scales.float()[..., None], biases.float()[..., None]
    q = g - b
    q /= torch.where(s > 0, s, torch.ones_like(s))
    return q.round_().clamp_(0, 15)


def _int4_error(g, h, q, scales, biases) -> torch.Tensor:
    """Each group's (h-weighted) squared error of codes q with float16 scales and biases."""
    d = q * scales.float()[..., None]
    d += biases.float()[..., None]
    d -= g
    d.pow_(2)
    return (d if h is None else d.mul_(h)).sum(dim=-1)


def integer_zero_scale(s: torch.Tensor) -> torch.Tensor:
    """float32 scales -> float16 scales of ZERO_SCALE_BITS significant bits, at least float16's smallest normal
    2^-14: z * scale is then a float16 for every z in 0..15 (module docstring)."""
    m, e = torch.frexp(s.clamp_min(2.0 ** -14))
    return torch.ldexp(torch.round(m * 2 ** ZERO_SCALE_BITS) / 2 ** ZERO_SCALE_BITS, e).half()


def integer_zeros(scales: torch.Tensor, biases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's zero point z (float32, whole numbers) and whether it holds the group exactly: bias == -z * scale
    in float32 with z in 0..15 and scale > 0, so q * scale + bias == (q - z) * scale. scales, biases: float32."""
    z = torch.round(-biases / torch.where(scales > 0, scales, torch.ones_like(scales)))
    whole = (scales > 0) & (z >= 0) & (z <= 15) & (-z * scales == biases)
    return z.clamp(0, 15), whole


def _zero_codes(g, h, s, z):
    """Codes of groups g for float16 scales s and zero points z [..., 1], and their h-weighted squared error."""
    sf = s.float()
    q = torch.round(g / sf + z).clamp(0, 15)
    return q, (h * ((q - z) * sf - g) ** 2).sum(dim=-1)


def _quantize_int4_zero_rows(w: torch.Tensor, group: int, ratios=CLIP_RATIOS, h: torch.Tensor | None = None):
    """_quantize_int4_rows with integer zero points: per clipping ratio r, the range [r min, r max] widened to hold
    0, its scale / 15 as integer_zero_scale, the zero point that puts r min on code 0; then _refit_int4_zero."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    h = torch.ones(1, k // group, group, device=w.device) if h is None else h
    lo, hi = g.amin(dim=-1, keepdim=True).clamp_max(0), g.amax(dim=-1, keepdim=True).clamp_min(0)
    best = None
    for r in ratios:
        s = integer_zero_scale((hi - lo) * r / 15)
        z = torch.round(-lo * r / s.float()).clamp(0, 15)
        candidate = (*_zero_codes(g, h, s, z), s, z)
        best = candidate if best is None else _lower_error(best, candidate)
    best_q, best_err, best_s, best_z = best
    if len(ratios) > 1:
        best_q, best_s, best_z = _refit_int4_zero(g, h, best_q, best_s, best_z, best_err)
    biases = (-best_z * best_s.float()).half()
    if not torch.isfinite(biases).all():
        raise LocalpdError(f"a group of values up to {g.abs().max().item():g} has no int4 scale within float16")
    return best_q.to(torch.uint8).reshape(n, k), best_s[..., 0].contiguous(), biases[..., 0].contiguous()


def _refit_int4_zero(g, h, q, s, z, err, rounds: int = 2):
    """Alternate: for the current codes, each of z - 1, z, z + 1 with its (h-weighted) least-squares scale, then
    the codes re-rounded to it; a group takes the best candidate only where it lowers the error. (On the default
    model's matrices two rounds gain 0.3% of the RMS error, eight rounds no more.)"""
    for _ in range(rounds):
        for shift in (0, -1, 1):
            zc = (z + shift).clamp(0, 15)
            c = q - zc
            fitted = (h * c * g).sum(-1, keepdim=True) / (h * c * c).sum(-1, keepdim=True).clamp_min(1e-30)
            sc = torch.where(fitted > 0, integer_zero_scale(fitted), s)
            q, err, s, z = _lower_error((q, err, s, z), (*_zero_codes(g, h, sc, zc), sc, zc))
    return q, s, z


def _lower_error(best: tuple, candidate: tuple) -> tuple:
    """Per group, whichever of two (codes [..., group], error [...], scale [..., 1], zero [..., 1]) errs less; the
    best one where they tie."""
    better = candidate[1] < best[1]
    return tuple(torch.where(better if i == 1 else better[..., None], c, b)
                 for i, (b, c) in enumerate(zip(best, candidate)))


def _refit_int4(g, h, q, scales, biases, err, rounds: int = 8):
    """Alternate: (h-weighted) least-squares scale and bias for the current codes, then re-round the codes. A
    group takes a round's result only where it lowers the (float16-rounded) reconstruction error."""
    weigh = (lambda x: x) if h is None else (lambda x: h * x)
    h_sum = (torch.ones_like(g[:1]) if h is None else h).sum(-1, keepdim=True)
    g_mean = weigh(g).sum(-1, keepdim=True) / h_sum
    g_centred = g - g_mean
    for _ in range(rounds):
        q_mean = weigh(q).sum(-1, keepdim=True) / h_sum
        q_centred = q - q_mean
        var = weigh(q_centred ** 2).sum(-1, keepdim=True)
        s = (weigh(q_centred) * g_centred).sum(-1, keepdim=True) / var.clamp_min(1e-12)
        s = torch.where(var > 0, s, torch.zeros_like(s))
        new_s, new_b = s[..., 0].half(), (g_mean - s * q_mean)[..., 0].half()
        new_q = _int4_codes(g, new_s, new_b)
        new_err = _int4_error(g, h, new_q, new_s, new_b)
        better = (new_err < err) & (new_s > 0)
        err = torch.where(better, new_err, err)
        q = torch.where(better[..., None], new_q, q)
        scales = torch.where(better, new_s, scales)
        biases = torch.where(better, new_b, biases)
    return q, scales, biases


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (values 0..15, K a multiple of 8) -> int32 [N, K // 8] in the documented layout."""
    n, k = q.shape
    if k % 8:
        raise LocalpdError(f"int4 needs the input dimension ({k}) to be a multiple of 8")
    q = q.to(torch.uint8)
    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # byte b: column 2b low, 2b + 1 high
    return pairs.view(torch.int32)  # little-endian: byte b of word j is bits 8b .. 8b+7


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n = packed.shape[0]
    pairs = packed.contiguous().view(torch.uint8)
    return torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(n, -1)


SUB16_TYPES = ("Q6_K", "Q3_K", "Q2_K")  # GGUF's types with a scale a sub-block of 16: quant/int6k.py's FROM_BLOCKS


def from_gguf(type_name: str, raw_blocks_uint8: torch.Tensor, shape: tuple[int, int]):
    """Import of a GGUF block type whose groups of 32 are codes * scale (+ bias) (quant.gguf_blocks): Q4_0 and Q4_1
    -> Int4Weight, Q4_K -> Int4KWeight (quant/int4k.py), Q5_0 and Q5_1 -> Int5Weight, Q5_K -> Int5KWeight
    (quant/int5.py), Q6_K -> Int6KWeight, Q3_K -> Int3KWeight and Q2_K -> Int2KWeight (quant/int6k.py), IQ4_NL,
    IQ4_XS and MXFP4 -> CodebookWeight (quant/codebook.py), Q8_0 -> Int8Weight, group 32.
    Bit for bit, but for IQ4_XS's scales (products of two stored fields), which are rounded to float16.

    `raw_blocks_uint8` holds the tensor's blocks as stored (any shape); `shape` is (N rows, K columns) with blocks
    running along K.
    """
    type_name = type_name.upper()
    if type_name not in gguf_blocks.DECODERS and type_name not in SUB16_TYPES:
        raise LocalpdError(f"GGUF type {type_name} cannot be imported as int4/int8 "
                           f"(supported: {', '.join(gguf_blocks.DECODERS)})")
    n, k = shape
    _, block, size = GGML_TYPES[type_name]
    if k % block:
        raise LocalpdError(f"GGUF {type_name} needs the input dimension ({k}) to be a multiple of {block}")
    raw = raw_blocks_uint8.reshape(-1)
    if raw.dtype != torch.uint8 or raw.numel() != n * (k // block) * size:
        raise LocalpdError(f"GGUF {type_name} data for a {n}x{k} tensor must be {n * (k // block) * size} uint8 bytes, "
                           f"got {raw.numel()} {raw.dtype}")
    rows = max(1, _CHUNK_ELEMENTS // k)  # the decoders' temporaries take several bytes a weight: rows at a time
    if n <= rows:
        return _from_gguf_rows(type_name, raw.reshape(-1, size), shape)
    per_row = raw.reshape(n, -1)
    return cat_rows([_from_gguf_rows(type_name, per_row[i:i + rows].reshape(-1, size), (min(rows, n - i), k))
                     for i in range(0, n, rows)])


def _from_gguf_rows(type_name: str, blocks: torch.Tensor, shape: tuple[int, int]):
    """from_gguf of checked blocks (uint8 [blocks, bytes a block]) of `shape`."""
    n, k = shape
    if type_name == "Q4_K":
        from localpd.quant.int4k import Int4KWeight  # it imports this module

        return Int4KWeight.from_q4_k(blocks, shape)
    if type_name in SUB16_TYPES:
        from localpd.quant.int6k import FROM_BLOCKS  # it imports this module

        return FROM_BLOCKS[type_name](blocks, shape)
    if type_name in gguf_blocks.INT5_TYPES:
        from localpd.quant.int5 import Int5KWeight, from_q5  # it imports this module

        return Int5KWeight.from_q5_k(blocks, shape) if type_name == "Q5_K" else from_q5(type_name, blocks, shape)
    g = gguf_blocks.DECODERS[type_name](blocks)
    scales = _half_scales(g.scale, type_name).reshape(n, k // 32)
    if type_name in gguf_blocks.INT4_TYPES:
        biases = _half_scales(g.bias, type_name).reshape(n, k // 32)
        return Int4Weight(pack_int4(g.codes.reshape(n, k)), scales, biases)
    if type_name in CODEBOOK_TYPES:
        return CODEBOOK_TYPES[type_name].from_values(g.codes.reshape(n, k), scales)
    return Int8Weight(g.codes.reshape(n, k).contiguous(), scales)


NEAR_STEPS = range(1, 9)


def int8_near(g: gguf_blocks.Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """_int8_near a bounded number of groups at a time (its candidates' temporaries are float32 copies)."""
    step = _CHUNK_ELEMENTS // 32
    parts = [_int8_near(gguf_blocks.Groups(*(t[i:i + step] for t in g))) for i in range(0, g.codes.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _int8_near(g: gguf_blocks.Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of codes * scale + bias (5-bit codes) as int8 codes and a scale per 32, with the least squared error
    among: scale / k for k in NEAR_STEPS, where the codes are k * code + round(bias * k / scale), off from what the
    file holds by one constant per group (the bias's remainder), and plain round-to-nearest (absmax / 127).
    Measured on Q5_1 tensors: 41% less error than round-to-nearest alone (docs/PERF.md)."""
    v = gguf_blocks.dequantize(g).reshape(-1, 32)
    best_err = best_codes = best_scale = None
    for s in [v.abs().amax(dim=1, keepdim=True) / 127] + [g.scale / k for k in NEAR_STEPS]:
        s = s.half().float()
        usable = torch.isfinite(s)  # a zero scale is usable: it gives zeros (all a group of zeros needs)
        divisor = torch.where(usable & (s != 0), s, torch.ones_like(s))
        codes = torch.where(s != 0, torch.round(v / divisor).clamp(-127, 127), torch.zeros_like(v))
        err = torch.where(usable, ((codes * s - v) ** 2).sum(dim=1, keepdim=True), torch.inf)
        if best_err is None:
            best_err, best_codes, best_scale = err, codes, torch.where(usable, s, torch.zeros_like(s))
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better, codes, best_codes)
        best_scale = torch.where(better, s, best_scale)
    if not torch.isfinite(best_err).all():
        raise LocalpdError(f"a block of values up to {v.abs().max().item():g} has no int8 scale within float16")
    return best_codes.to(torch.int8), best_scale


def _half_scales(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 scales or biases -> float16, refusing what float16 cannot hold."""
    h = x.half()
    if not torch.isfinite(h).all():
        raise LocalpdError(f"GGUF {type_name}: a block scale of {x[~torch.isfinite(h)].flatten()[0].item():g} "
                           f"does not fit float16 (largest 65504)")
    return h.contiguous()


Weight = torch.Tensor | Int4Weight | Int8Weight | Nf4Weight | BnbInt8Weight  # a weight matrix in any format


def symmetric(w) -> bool:
    """Whether each bias of an int4 or 5-bit weight is exactly its group's scale times its class's SYMMETRIC_BIAS
    (a Q4_0 file's -8 d, Q5_0's -16 d): the CPU kernels then read no biases (kernels/cpu.py's weight_plan). Worked
    out once a weight."""
    got = w.__dict__.get("_symmetric")
    if got is None:
        times = getattr(type(w), "SYMMETRIC_BIAS", None)
        got = times is not None and w.biases.shape == w.scales.shape and torch.equal(w.biases, w.scales * times)
        w.__dict__["_symmetric"] = got
    return got


def cpu_biases_skipped(w) -> int:
    """The bytes of a symmetric weight's biases where it is on the CPU, whose kernels work them out: not read."""
    return w.biases.nbytes if w.scales.device.type == "cpu" and symmetric(w) else 0


def weight_nbytes(w: Weight) -> int:
    """Bytes a kernel reads to use all of w."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def cat_rows(weights: list[Weight]) -> Weight:
    """Stack matrices of one format (and group) along the output dimension: [N1, K] + [N2, K] -> [N1 + N2, K].
    Every quantized format (bitsandbytes' too) is a dataclass of tensors indexed by output row. Parts made as row
    ranges of one tensor (a GGUF load's fused matrices, localpd/load/placement.py) are joined without a copy."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        return join_rows(weights)
    return type(first)(*(join_rows([getattr(w, f) for w in weights]) for f in first.__dataclass_fields__))


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts): a view where each part is contiguous and starts where the one before ends, in one
    storage."""
    first, at = parts[0], parts[0].data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or p.data_ptr() != at
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts)
        at += p.nbytes
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def take_rows(w: Weight, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense rows of w (an embedding lookup), dequantizing only those rows."""
    if isinstance(w, torch.Tensor):
        return w[rows].to(dtype)
    if hasattr(w, "take_rows"):  # a layout whose tensors are not indexed by output row (quant/kmajor.py)
        return w.take_rows(rows, dtype)
    return type(w)(*(getattr(w, f)[rows] for f in w.__dataclass_fields__)).dequantize(dtype)
