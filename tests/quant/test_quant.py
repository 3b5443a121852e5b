"""Weight formats: quantization error, the packed int4 layout, exact byte counts, lossless GGUF import."""

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from localpd.errors import LocalpdError
from localpd.quant.codebook import IQ4Weight, MXFP4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant import weights as weights_module
from localpd.quant.weights import Int4Weight, Int8Weight, from_gguf, integer_zeros, pack_int4, unpack_int4


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_per_channel_error(seed):
    w = torch.randn(72, 384, generator=torch.Generator().manual_seed(seed)) * 0.05
    q = Int8Weight.quantize(w)
    assert q.group == 384 and q.data.dtype == torch.int8 and q.scales.shape == (72, 1)
    assert rel_err(q.dequantize(), w) < 0.01
    assert rel_err(Int8Weight.quantize(w, group=32).dequantize(), w) < 0.01


@pytest.mark.parametrize("group,bound", [(32, 0.09), (64, 0.10), (128, 0.11)])
def test_int4_error_and_clipping_never_worse_than_rtn(group, bound):
    w = torch.randn(200, 384, generator=torch.Generator().manual_seed(group))
    q, rtn = Int4Weight.quantize(w, group), Int4Weight.quantize_rtn(w, group)
    assert q.group == group and q.packed.shape == (200, 48) and q.scales.dtype == torch.float16
    assert rel_err(q.dequantize(), w) < bound
    # per group, the search keeps ratio 1.0 (= RTN) unless another ratio is strictly better
    err = ((q.dequantize() - w) ** 2).reshape(200, -1, group).sum(-1)
    err_rtn = ((rtn.dequantize() - w) ** 2).reshape(200, -1, group).sum(-1)
    assert (err <= err_rtn + 1e-6).all()
    assert err.sum() < err_rtn.sum()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_integer_zero_points_hold_every_group_exactly(group):
    """integer_zero=True: every group's bias is -z * scale for a whole z in 0..15, so q * scale + bias is (q - z) *
    scale in float32 to the last bit (what GPTQ, AWQ and compressed-tensors store); the scale keeps 7 significant
    bits. Its error is near the float-bias scheme's and below plain min/max rounding to an integer zero point."""
    with torch.random.fork_rng():  # seeded: the unseeded draw depended on what the worker ran before (once 0.1% short)
        torch.manual_seed(group)
        w = torch.distributions.StudentT(5.0).sample((200, 384)) * 0.02
    q = Int4Weight.quantize(w, group, integer_zero=True)
    scale, bias = q.scales.float(), q.biases.float()
    zero, whole = integer_zeros(scale, bias)
    assert bool(whole.all()) and not bool((zero == 8).all())
    codes = q.unpack().float().reshape(200, -1, group)
    assert torch.equal(((codes - zero[..., None]) * scale[..., None]).reshape(200, 384), q.dequantize())
    mantissa, _ = torch.frexp(scale)
    assert torch.equal(mantissa * 2 ** 7, torch.round(mantissa * 2 ** 7))
    lo, hi = w.reshape(200, -1, group).amin(-1).clamp_max(0), w.reshape(200, -1, group).amax(-1).clamp_min(0)
    s = ((hi - lo) / 15)[..., None]
    z = torch.round(-lo[..., None] / s)
    rtn = ((torch.round(w.reshape(200, -1, group) / s + z).clamp(0, 15) - z) * s).reshape(200, 384)
    err, err_float = rel_err(q.dequantize(), w), rel_err(Int4Weight.quantize(w, group).dequantize(), w)
    assert err < 0.97 * rel_err(rtn, w) and err < 1.1 * err_float, (err, rel_err(rtn, w), err_float)
    nearest = Int4Weight.quantize_rtn(w, group, integer_zero=True)  # ratio 1.0 alone: the search never does worse
    assert bool(integer_zeros(nearest.scales.float(), nearest.biases.float())[1].all())
    per_group = [((x.dequantize() - w) ** 2).reshape(200, -1, group).sum(-1) for x in (q, nearest)]
    assert (per_group[0] <= per_group[1]).all() and per_group[0].sum() < per_group[1].sum()


def test_int4_integer_zero_points_weigh_error_by_importance():
    """Calibration's importance counts with integer zero points too: the columns it weighs come out nearer."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 256, generator=g) * 0.02
    importance = torch.ones(256)
    importance[::4] = 100.0
    plain, weighted = (Int4Weight.quantize(w, 64, imp, integer_zero=True) for imp in (None, importance))
    heavy = slice(0, None, 4)
    assert rel_err(weighted.dequantize()[:, heavy], w[:, heavy]) < 0.9 * rel_err(plain.dequantize()[:, heavy],
                                                                                   w[:, heavy])
    assert bool(integer_zeros(weighted.scales.float(), weighted.biases.float())[1].all())


def test_int4_clipping_helps_heavy_tails():
    torch.manual_seed(5)
    w = torch.distributions.StudentT(3.0).sample((64, 256))
    q, rtn = Int4Weight.quantize(w, 32), Int4Weight.quantize_rtn(w, 32)
    assert rel_err(q.dequantize(), w) < 0.99 * rel_err(rtn.dequantize(), w)


def test_int4_packed_layout():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for j in range(8):
        for s in range(8):  # column 8j + s in bits 4s .. 4s+3 of word j
            assert torch.equal((words[:, j] >> (4 * s)) & 15, q[:, 8 * j + s].to(torch.int64))
    as_bytes = packed.view(torch.uint8)  # byte b: column 2b low nibble, 2b + 1 high nibble
    assert torch.equal(as_bytes & 15, q[:, 0::2]) and torch.equal(as_bytes >> 4, q[:, 1::2])
    assert torch.equal(unpack_int4(packed), q)


def test_nbytes_exact():
    w = torch.randn(40, 256)
    for g in (32, 64, 128):
        assert Int4Weight.quantize(w, g).nbytes == 40 * 256 // 2 + 2 * 2 * 40 * (256 // g)
    assert Int8Weight.quantize(w).nbytes == 40 * 256 + 2 * 40
    assert Int8Weight.quantize(w, 32).nbytes == 40 * 256 + 2 * 40 * 8


def test_zero_and_constant_rows_stay_finite():
    w = torch.zeros(3, 64)
    w[1] = 0.25
    for q in (Int4Weight.quantize(w, 32), Int8Weight.quantize(w)):
        d = q.dequantize()
        assert torch.isfinite(d).all() and torch.allclose(d, w, rtol=0, atol=1e-4)
    d = Int4Weight.quantize(w, 32, integer_zero=True).dequantize()  # within its 7-bit scale's rounding
    assert torch.isfinite(d).all() and torch.allclose(d, w, rtol=0, atol=0.25 * 2 ** -8) and not d[0].any()


def test_dequantize_dtype():
    w = torch.randn(8, 128)
    q = Int4Weight.quantize(w, 64)
    assert q.dequantize(torch.float16).dtype == torch.float16
    assert torch.equal(q.dequantize(torch.float16), q.dequantize().half())


def test_group_errors():
    with pytest.raises(LocalpdError, match=r"int4-g128 needs the input dimension \(576\) to be a multiple of 128"):
        Int4Weight.quantize(torch.randn(4, 576), 128)
    with pytest.raises(LocalpdError, match=r"int8-g32 needs the input dimension \(100\) to be a multiple of 32"):
        Int8Weight.quantize(torch.randn(4, 100), 32)
    with pytest.raises(LocalpdError, match="group size"):
        Int4Weight.quantize(torch.randn(4, 96), 48)
    with pytest.raises(LocalpdError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.uint8))


# bytes of a block after its float16 scale fields (the rest of the block is random)
F16_FIELDS = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q4_K": 2, "IQ4_NL": 1, "IQ4_XS": 1, "MXFP4": 0,
              "Q5_1": 2, "Q5_K": 2}
ROUNDED = {"IQ4_XS"}  # its scales are products of two stored fields, rounded to float16 on import


def _random_blocks(type_name, n_blocks, rng):
    """GGUF blocks with random finite f16 scales (and mins) and random bytes in the rest; MXFP4's scale byte in the
    range float16 holds."""
    def f16(lo, hi):
        mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n_blocks)) * rng.choice([-1, 1], n_blocks)
        return mag.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    hi = 100 if type_name == "Q4_0" else 10
    parts = [f16(1e-6, hi) for _ in range(F16_FIELDS[type_name])]
    if type_name == "MXFP4":
        parts.append(rng.integers(110, 140, (n_blocks, 1), dtype=np.uint8))
    rest = size - sum(p.shape[1] for p in parts)
    return np.concatenate(parts + [rng.integers(0, 256, (n_blocks, rest), dtype=np.uint8)], axis=1)


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gguf_import_is_exact(type_name, seed):
    rng = np.random.default_rng(seed)
    n, k = 24, 256 * (seed + 1)
    block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = _random_blocks(type_name, n * k // block, rng)
    expected = torch.from_numpy(gguf_dequantize(blocks.reshape(-1), GGMLQuantizationType[type_name]).reshape(n, k))
    w = from_gguf(type_name, torch.from_numpy(blocks.reshape(-1).copy()), (n, k))
    assert isinstance(w, {"Q4_0": Int4Weight, "Q4_1": Int4Weight, "Q4_K": Int4KWeight, "IQ4_NL": IQ4Weight,
                          "IQ4_XS": IQ4Weight, "MXFP4": MXFP4Weight, "Q5_0": Int5Weight, "Q5_1": Int5Weight,
                          "Q5_K": Int5KWeight}.get(type_name, Int8Weight))
    assert w.group == 32 and w.shape == (n, k)
    got = w.dequantize(torch.float32)
    if type_name in ROUNDED:  # each value off by at most float16's rounding of its scale (and bias)
        scale = w.scales.float().abs().repeat_interleave(32, dim=1)
        bound = 2 ** -11 * scale * 127
        assert ((got - expected.float()).abs() <= bound).all()
    else:
        assert torch.equal(got, expected.float())
    assert w.nbytes <= blocks.nbytes * 2 + n * k // 32 * 2  # at most int8 codes and a float16 scale per 32


@pytest.mark.parametrize("type_name", list(F16_FIELDS) + ["Q6_K"])
def test_gguf_import_a_few_rows_at_a_time_is_the_import_in_one_piece(type_name, monkeypatch):
    """from_gguf converts a large tensor a few rows at a time (its decoders' temporaries take several bytes a weight:
    at once, a 128k x 4096 output head's took gigabytes): the pieces stacked are the whole tensor's import, every
    field bit for bit, the last piece short."""
    rng = np.random.default_rng(7)
    n, k = 37, 512
    block = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    if type_name == "Q6_K":  # its float16 d is the block's last two bytes
        raw = rng.integers(0, 256, (n * k // block, 210), dtype=np.uint8)
        raw[:, 208:210] = rng.uniform(-2, 2, (n * k // block, 1)).astype(np.float16).view(np.uint8)
    else:
        raw = _random_blocks(type_name, n * k // block, rng)
    whole = from_gguf(type_name, torch.from_numpy(raw.reshape(-1).copy()), (n, k))
    monkeypatch.setattr(weights_module, "_CHUNK_ELEMENTS", 5 * k)  # 5 rows a piece: 8 pieces, the last of 2
    pieces = from_gguf(type_name, torch.from_numpy(raw.reshape(-1).copy()), (n, k))
    assert type(pieces) is type(whole) and pieces.shape == (n, k)
    assert all(torch.equal(getattr(pieces, f), getattr(whole, f)) for f in whole.__dataclass_fields__)


@pytest.mark.parametrize("type_name", ["Q5_1", "Q5_K"])
def test_the_gpus_int8_form_of_5_bit_codes_beats_round_to_nearest(type_name):
    """5-bit codes with a bias have no exact int8 form (the GPU's, as_int8): each group's error is at most plain
    round-to-nearest's (int8, absmax / 127 per 32), and over all groups well below it."""
    rng = np.random.default_rng(3)
    n, k = 32, 512
    block = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    blocks = _random_blocks(type_name, n * k // block, rng)
    exact = torch.from_numpy(gguf_dequantize(blocks.reshape(-1), GGMLQuantizationType[type_name]).reshape(n, k))
    w = from_gguf(type_name, torch.from_numpy(blocks.reshape(-1).copy()), (n, k)).to_int8()
    assert isinstance(w, Int8Weight) and w.group == 32
    rtn = Int8Weight.quantize(exact, 32)
    err = ((w.dequantize() - exact) ** 2).reshape(-1, 32).sum(1)
    err_rtn = ((rtn.dequantize() - exact) ** 2).reshape(-1, 32).sum(1)
    assert (err <= err_rtn * (1 + 1e-6)).all()
    assert err.sum() < 0.8 * err_rtn.sum()


def test_gguf_import_scale_beyond_float16():
    """IQ4_XS: d = 65504 times a sub-block scale of 16 or more is no float16, a one-line error. Q4_K keeps d and its
    six-bit scales apart (int4-k), so its largest scales import as they are."""
    block = np.zeros(136, dtype=np.uint8)
    block[0:2] = np.array([65504], dtype=np.float16).view(np.uint8)
    block[2:4] = 255  # the scales' high bits: every sub-block's scale 48 or more, less 32
    with pytest.raises(LocalpdError, match="float16"):
        from_gguf("IQ4_XS", torch.from_numpy(block), (1, 256))
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([65504], dtype=np.float16).view(np.uint8)
    block[4] = 63
    w = from_gguf("Q4_K", torch.from_numpy(block), (1, 256))
    assert w.dequantize()[0, 0].item() == 0.0 and torch.isfinite(w.dequantize()).all()


def test_gguf_import_errors():
    with pytest.raises(LocalpdError, match="IQ2_XS"):  # no import of its own: re-quantized from its values
        from_gguf("IQ2_XS", torch.zeros(74, dtype=torch.uint8), (1, 256))
    with pytest.raises(LocalpdError, match="multiple of 32"):
        from_gguf("Q8_0", torch.zeros(34, dtype=torch.uint8), (1, 48))
    with pytest.raises(LocalpdError, match="bytes"):
        from_gguf("Q4_1", torch.zeros(18, dtype=torch.uint8), (1, 32))
