"""localpd's CPU kernels (kernels/cpu_kernels.c) against their torch references, on fresh random inputs with odd
shapes, for every instruction set this processor can run: AVX512-VNNI, AVX2 and plain C are each built and
checked where the machine has them."""

import dataclasses
import platform
import re
import sys
from pathlib import Path

import pytest
import torch

from localpd.kernels import cpu
from localpd.kernels.dispatch import (PreNorm, as_int8, codebook_matmul_ref, int4_matmul_ref, int4k_matmul_ref,
                                     int5_matmul_ref, int8_matmul_ref)
from localpd.kernels.fused_dispatch import act_mul_ref, add_rms_norm_ref
from localpd.kvcache.dispatch import paged_attention_ref, rope_write_kv_ref
from localpd.kvcache.formats import dequantize_kv, kv_formats, new_kv_pool
from localpd.quant.codebook import CodebookWeight, IQ4Weight, MXFP4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight, split_codes
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, pack_int4, symmetric

X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(autouse=True)
def float32_prefill(monkeypatch):
    """Prefill's float32 GEMMs, whose products these tests hold to the references on the rounded input; an AMX
    processor's bfloat16 GEMMs (cpu.prefill_bf16) have a test of their own."""
    monkeypatch.setattr(cpu, "prefill_bf16", lambda: False)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


FLAGS = _cpu_flags()
# (march, the instruction set it selects, whether this processor runs it)
VARIANTS = [("native", None, True)]
if X86:
    VARIANTS += [("haswell", "avx2", {"avx2", "fma", "f16c"} <= FLAGS),
                 ("x86-64", "c", True),
                 ("icelake-server", "avx512-vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def lib(request, tmp_path_factory):
    march, isa, runs = request.param
    if not runs:
        pytest.skip(f"this processor cannot run -march={march}")
    try:
        path = cpu.build(march, tmp_path_factory.mktemp(f"cpu-{march}"))
    except RuntimeError as e:
        pytest.skip(str(e))
    built = cpu.open_library(path)
    if isa:
        assert built.lpd_isa().decode() == isa
    return built


def rounded_rows(h: torch.Tensor) -> torch.Tensor:
    """h as lpd_linear rounds its input: every block of 32 to two int8 levels, hi at step amax / 127 and lo, what
    is left, at 1/256 of it (clamped to +-127)."""
    g = h.float().reshape(*h.shape[:-1], -1, 32)
    step = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    hi = torch.round(g * inv)
    lo = torch.round((g - hi * step) * inv * 256).clamp(-127, 127)
    return ((256 * hi + lo) * (step / 256)).reshape(h.shape)


CODEBOOKS = {"iq4": IQ4Weight, "mxfp4": MXFP4Weight}


def weights(kind: str, n: int, k: int, group: int, g: torch.Generator):
    if kind in CODEBOOKS:  # random codes (every one of the 16), scales of several magnitudes
        cls = CODEBOOKS[kind]
        values = cls.table[torch.randint(0, 16, (n, k), generator=g)]
        scales = (torch.rand(n, k // 32, generator=g) * torch.rand(n, 1, generator=g) * 0.05).half()
        return cls.from_values(values, scales)
    if kind == "int6k":  # Q6_K: every code 0..63, int8 scales of either sign a sub-block of 16
        codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
        d = (torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half()
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        return Int6KWeight.from_codes(codes, d, sc)
    if kind == "int3k":  # Q3_K's form in nibbles: every code 0..15 (Q3_K's own 4..11), int8 scales a sub-block of 16
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = (torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half()
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        return Int3KWeight(pack_int4(codes), d, sc)
    if kind == "int2k":  # Q2_K's form: codes 0..3 in nibbles, scales and minima 0..15 a sub-block of 16
        codes = torch.randint(0, 4, (n, k), generator=g, dtype=torch.uint8)
        d, dmin = ((torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half() for _ in range(2))
        sc, mn = (torch.randint(0, 16, (n, k // 16), generator=g).to(torch.int8) for _ in range(2))
        return Int2KWeight(pack_int4(codes), d, dmin, sc, mn)
    if kind in ("int5", "int5k"):  # every code 0..31; int4-g32's or int4-k's factors from a random matrix's
        codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
        low = weights("int4" if kind == "int5" else "int4k", n, k, 32, g)
        if kind == "int5":
            return Int5Weight.from_codes(codes, low.scales, low.biases)
        return Int5KWeight(*split_codes(codes), low.d, low.dmin, low.sub)
    dense = torch.randn(n, k, generator=g)
    if kind == "int4k":
        return Int4KWeight.from_int4(Int4Weight.quantize_rtn(dense, 32))
    if kind == "int4":
        return Int4Weight.quantize_rtn(dense, group)
    return Int8Weight.quantize(dense, None if group == k else group)


def ref(w, x, bias=None, gated=None, norm=None):
    if isinstance(w, CodebookWeight):
        return codebook_matmul_ref(x, w, bias=bias, gated=gated, norm=norm)
    if isinstance(w, (Int5Weight, Int5KWeight, Int6KWeight, Int3KWeight, Int2KWeight)):
        return int5_matmul_ref(x, w, bias=bias, gated=gated, norm=norm)
    if isinstance(w, Int4KWeight):
        return int4k_matmul_ref(x, w, bias=bias, gated=gated, norm=norm)
    if isinstance(w, Int4Weight):
        return int4_matmul_ref(x, w.packed, w.scales, w.biases, w.group, bias=bias, gated=gated, norm=norm)
    return int8_matmul_ref(x, w.data, w.scales, w.group, bias=bias, gated=gated, norm=norm)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# (m, n, k): batch 1 four rows at a time with rows left over (70 x 576), an odd block count (96), one row (1 x 4096),
# a few rows (3, 5, 9), a single block (32); from cpu.GEMM_ROWS rows on, prefill's dequantize-and-GEMM path: its
# fewest rows (16 x 61: one thread's slice), a prompt's (128 x 1000, slices of uneven length) and an odd count (37)
SHAPES = [(1, 61, 96), (1, 70, 576), (1, 64, 1536), (3, 128, 576), (5, 17, 32), (9, 33, 1536), (1, 1, 4096),
          (16, 61, 96), (37, 200, 576), (128, 1000, 1536)]
GROUPS = [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32), ("int8", None),  # None: one scale per row
          ("int4k", 32), ("int5", 32), ("int5k", 32), ("int6k", 256), ("int3k", 256), ("int2k", 256), ("iq4", 32),
          ("mxfp4", 32)]


@pytest.mark.parametrize("kind,group,m,n,k", [(kind, group, *shape) for kind, group in GROUPS for shape in SHAPES
                                              if group is None or shape[2] % group == 0])
def test_linear_matches_the_reference_on_its_rounded_input(lib, kind, group, m, n, k):
    """Exact up to float summation against the reference fed the int8-rounded input; within the rounding's own
    size of the reference fed the input as it is."""
    group = k if group is None else group
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = weights(kind, n, k, group, g)
    x = torch.randn(m, k, generator=g) * 3
    bias = torch.randn(n, generator=g)
    y = cpu.linear(x, w, bias, lib=lib)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, ref(w, rounded_rows(x), bias)) < 2e-5
    assert rel_err(y, ref(w, x, bias)) < 1e-4


@pytest.mark.parametrize("kind", ["int4", "int8", "int4k", "int5k", "iq4"])
@pytest.mark.parametrize("m", [16, 37, 128])
def test_prefill_rows_in_bfloat16_multiply_the_rounded_operands(lib, kind, m, monkeypatch):
    """LOCALPD_PREFILL_BF16's GEMM (cpu.prefill_bf16): the rounded input and each dequantized weight slice rounded to
    bfloat16, float32 sums: the product of those bfloat16 operands (within float32's summation), near the float32
    path's."""
    if cpu.torch_blas("cblas_gemm_bf16bf16f32") is None:
        pytest.skip("torch's library has no MKL bfloat16 GEMM")
    g = torch.Generator().manual_seed(m)
    w = weights(kind, 300, 576, 32, g)
    x, bias = torch.randn(m, 576, generator=g), torch.randn(300, generator=g)
    exact = cpu.linear(x, w, bias, lib=lib)
    monkeypatch.setattr(cpu, "prefill_bf16", lambda: True)
    got = cpu.linear(x, w, bias, lib=lib)
    dense = ref(w, torch.eye(576)).T  # the dequantized weight [300, 576]
    bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    want = (bf(rounded_rows(x)) @ bf(dense).T + bias.double()).float()
    assert rel_err(got, want) < 1e-4  # seen: 3e-5 at 128 rows (the BLAS's order of sums)
    assert 0 < rel_err(got, exact) < 1e-2


@pytest.mark.parametrize("kind,group", GROUPS)
def test_prefill_takes_each_weight_in_bfloat16_as_its_value_rounded(lib, kind, group, monkeypatch):
    """The bfloat16 GEMM's weight slices (made in registers for int4 and int8 weights, a row through float32 for the
    rest) are the dequantized values rounded to bfloat16, bit for bit: rows of the identity pick them out exactly."""
    if cpu.torch_blas("cblas_gemm_bf16bf16f32") is None:
        pytest.skip("torch's library has no MKL bfloat16 GEMM")
    k = 512
    g = torch.Generator().manual_seed(len(kind) * 100 + (group or 0))
    w = weights(kind, 100, k, k if group is None else group, g)
    picked = torch.randperm(k, generator=g)[:cpu.GEMM_ROWS + 3]
    monkeypatch.setattr(cpu, "prefill_bf16", lambda: True)
    got = cpu.linear(torch.eye(k)[picked], w, lib=lib)
    dense = ref(w, torch.eye(k)).T  # [100, k]
    assert torch.equal(got, dense[:, picked].T.to(torch.bfloat16).float())


@pytest.mark.parametrize("kind", ["int4", "int8", "int4k", "int5k", "iq4"])
def test_prefill_rows_without_a_blas_take_torch_mm_and_match(lib, kind, monkeypatch):
    """Where torch's library exports no sgemm, lpd_dequant_gemm says so and the rows go through torch.mm over the
    dequantized weight: the same products."""
    monkeypatch.setattr(cpu, "integer_prefill", lambda: False)
    g = torch.Generator().manual_seed(21)
    w = weights(kind, 300, 576, 32, g)
    x, bias = torch.randn(40, 576, generator=g), torch.randn(300, generator=g)
    with_blas = cpu.linear(x, w, bias, lib=lib)
    lib.lpd_set_sgemm(None)
    try:
        without = cpu.linear(x, w, bias, lib=lib)
    finally:
        lib.lpd_set_sgemm(cpu.torch_sgemm())
    assert rel_err(without, with_blas) < 1e-6
    assert rel_err(without, ref(w, rounded_rows(x), bias)) < 2e-5


def integer_gemm(lib) -> bool:
    """Whether the library multiplies prefill's rows in lpd_prefill_gemm's int16 products (AVX512-VNNI builds)."""
    return lib.lpd_isa().decode() == "avx512-vnni"


def prefill_gemm(lib, x, w, bias=None, nth=2):
    """cpu._integer_gemm (lpd_prefill_gemm) on plain rows, on nth threads: whether it took them, and y."""
    p = cpu.weight_plan(w)
    y = torch.full((x.shape[0], p.n), float("nan"))
    threads = torch.get_num_threads()
    torch.set_num_threads(nth)
    try:
        return cpu._integer_gemm(lib, p, 0, x, None, None, 0.0, None, bias, y), y
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind,group", GROUPS)
@pytest.mark.parametrize("m,n,k", [(16, 61, 256), (17, 7, 512), (45, 200, 768), (100, 13, 1536)])
def test_the_integer_prefill_gemm_is_the_reference_on_its_rounded_input(lib, kind, group, m, n, k, monkeypatch):
    """lpd_prefill_gemm (AVX512-VNNI; other builds say no, -3, and the float GEMM multiplies): every weight format
    (Q2_K's minima a sub-block of 16 taken off after its products),
    rows past a tile's 32 and 16 (the rest padded), weight rows past a tile's 6, one or two threads, the layer's
    bias: the torch reference on the rounded input within float32's summation, what cpu.linear gives, and the float
    GEMM's product."""
    group = k if group is None else group
    if k % group:
        pytest.skip(f"groups of {group} do not divide {k}")
    g = torch.Generator().manual_seed(m * 7 + n + len(kind))
    w = weights(kind, n, k, group, g)
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    took, y = prefill_gemm(lib, x, w, bias, nth=1 + m % 2)
    assert took == integer_gemm(lib)  # other builds say no (-3)
    if not took:
        return
    assert rel_err(y, ref(w, rounded_rows(x), bias)) < 2e-5
    assert torch.equal(cpu.linear(x, w, bias, lib=lib), y)
    monkeypatch.setattr(cpu, "integer_prefill", lambda: False)
    assert rel_err(cpu.linear(x, w, bias, lib=lib), y) < 2e-5


@pytest.mark.parametrize("kind", ["int4", "int8", "int4k", "int6k", "iq4"])
def test_the_integer_prefill_gemm_with_the_norm_or_the_gate_in_front(lib, kind):
    """The integer GEMM's input step is lpd_linear's: RMSNorm(x + residual) (the sum stored) or act(gate) * up."""
    g = torch.Generator().manual_seed(17)
    m, n, k = 40, 70, 512
    w = weights(kind, n, k, 256 if kind == "int6k" else 32, g)
    x, res, nw = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5
    norm = PreNorm(res, nw, 1e-5)
    y, s = cpu.linear(x, w, None, None, norm, lib=lib)
    h, s_ref = add_rms_norm_ref(x, res, nw, 1e-5)
    assert torch.equal(s, s_ref)
    assert rel_err(y, ref(w, rounded_rows(h))) < 2e-5
    x2 = torch.randn(m, 2 * k, generator=g) * 2
    assert rel_err(cpu.linear(x2, w, None, "silu", lib=lib), ref(w, rounded_rows(act_mul_ref(x2, "silu")))) < 2e-5


def test_the_integer_prefill_gemm_of_q6k_extremes_does_not_overflow(lib):
    """Q6_K's values sc x (q - 32) reach 4096: against a block of one value (each 256 x 127 = 32512), 32 products
    of them a lane would pass 2^31. A lane sums 16 of them before its floats: the reference's value."""
    if not integer_gemm(lib):
        pytest.skip("an AVX512-VNNI build's GEMM")
    m, n, k = 16, 8, 512
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[1::2] = 63  # q - 32 = 31 on every other weight row
    w = Int6KWeight.from_codes(codes, torch.full((n, k // 256), 1e-3).half(), torch.full((n, k // 16), -128,
                                                                                        dtype=torch.int8))
    x = torch.ones(m, k)
    x[::3] = -2.5
    took, y = prefill_gemm(lib, x, w)
    assert took
    want = ref(w, rounded_rows(x))
    assert want.abs().min() > 1e3 and rel_err(y, want) < 1e-6


def test_the_integer_prefill_gemm_declines_an_odd_number_of_blocks(lib):
    """Rows of an odd number of blocks (96 columns) are not the integer GEMM's (-3): the float GEMM takes them."""
    g = torch.Generator().manual_seed(4)
    w = weights("int4", 30, 96, 32, g)
    x = torch.randn(20, 96, generator=g)
    assert not prefill_gemm(lib, x, w)[0]
    assert rel_err(cpu.linear(x, w, lib=lib), ref(w, rounded_rows(x))) < 2e-5


@pytest.mark.parametrize("n,k,nth", [(3072, 576, 2), (576, 1536, 2), (61, 96, 1), (10, 32768, 4)])
def test_a_prefill_slice_fits_the_l2_and_leaves_every_thread_work(n, k, nth):
    rows = cpu.gemm_slice(n, k, nth)
    assert rows % 8 == 0 and rows >= 8
    assert rows == 8 or rows * k * 4 <= cpu.SLICE_BYTES  # a thread's slice stays in its core's L2
    assert rows == 8 or rows <= -(-n // (4 * nth))  # each thread takes four slices or more


@pytest.mark.parametrize("kind", ["int4", "int8", "int4k", "int5k", "iq4"])
@pytest.mark.parametrize("residual", [False, True])
def test_linear_with_rms_norm_in_front(lib, kind, residual):
    g = torch.Generator().manual_seed(5 + residual)
    m, n, k = 3, 70, 192
    w = weights(kind, n, k, 32, g)
    x, res, nw = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5
    norm = PreNorm(res if residual else None, nw, 1e-5)
    y, s = cpu.linear(x, w, None, None, norm, lib=lib)
    h, s_ref = add_rms_norm_ref(x, norm.residual, nw, 1e-5)
    assert torch.equal(s, s_ref)
    assert rel_err(y, ref(w, rounded_rows(h))) < 2e-5
    y_ref, _ = ref(w, x, norm=norm)
    assert rel_err(y, y_ref) < 1e-4


@pytest.mark.parametrize("kind", ["int4", "int8", "int4k", "int5k", "iq4"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_linear_with_the_gate_in_front(lib, kind, act):
    g = torch.Generator().manual_seed(9)
    m, n, k = 4, 50, 160
    w = weights(kind, n, k, 32, g)
    x = torch.randn(m, 2 * k, generator=g) * 2
    y = cpu.linear(x, w, None, act, lib=lib)
    assert rel_err(y, ref(w, rounded_rows(act_mul_ref(x, act)))) < 2e-5
    assert rel_err(y, ref(w, x, gated=act)) < 1e-4


def test_linear_of_an_all_zero_block_and_extreme_values(lib):
    """A block of zeros rounds to scale 0 (no division by it); a block with one huge value keeps it."""
    g = torch.Generator().manual_seed(3)
    w = weights("int4", 24, 128, 32, g)
    x = torch.randn(2, 128, generator=g)
    x[0, :32] = 0
    x[1, 40] = 1e4
    y = cpu.linear(x, w, lib=lib)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref(w, rounded_rows(x))) < 2e-5


def test_the_input_rounding_is_the_references(lib):
    """lpd_round_input (what a prefill multiplies, by the decode products' own code) gives rounded_rows' values:
    every block's integers 256 hi + lo within int8's two levels."""
    g = torch.Generator().manual_seed(13)
    m, k = 7, 1600
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 5
    out = torch.empty(m, k)
    lib.lpd_round_input(0, x.data_ptr(), None, None, 0.0, None, m, k, out.data_ptr(), 1)
    assert rel_err(out, rounded_rows(x)) < 1e-6
    unit = x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 127 / 256
    assert (torch.round(out.reshape(m, -1, 32) / unit).abs() <= 127 * 256 + 127).all()
    # the GPU's integer GEMV rounds its inputs by the same rule (kernels/act_round.py): the same values, up to a
    # level where a float operation rounds a last bit apart at a tie
    from localpd.kernels.act_round import rounded_act_ref

    gpu = rounded_act_ref(x).reshape(m, -1, 32)
    assert ((out.double().reshape(m, -1, 32) - gpu).abs() <= 2.001 * unit.double()).all()
    levels = [torch.round(t / unit.double()) for t in (out.double().reshape(m, -1, 32), gpu)]
    assert (levels[0] == levels[1]).float().mean() > 0.999


# the page formats the library reads and writes (cpu.kv_sides); int4ch's writes take stage slots (STAGED)
KV = ["fp32", "fp16", "int8", "int4", "int8/int4", "int4ch", "int4ch/int4"]
STAGED = ["int4ch", "int4ch/int4"]


def _pool(D, H, ps, n_pages, g, kv="fp32", layers=1, stage_rows=1):
    """A pool of random pages: float values, or codes with their scales and zeros (never zeros); int4ch's stage of
    open pages random values too."""
    if "int4" in kv and D % 32:
        pytest.skip("int4 and int4ch pages hold heads of whole groups of 32")
    pool = new_kv_pool(kv, layers, n_pages, ps, H, D, torch.float32, "cpu", stage_rows=stage_rows)
    for data, scale, zero, stage, fmt in zip((pool.k, pool.v), (pool.k_scale, pool.v_scale),
                                             (pool.k_zero, pool.v_zero), (pool.k_stage, pool.v_stage),
                                             kv_formats(kv)):
        codes = {"int8": (-127, 128), "int4": (0, 256), "int4ch": (0, 256)}.get(fmt)
        data.copy_(torch.randint(*codes, data.shape, generator=g) if codes else torch.randn(data.shape, generator=g))
        if scale is not None:
            scale.copy_(torch.rand(scale.shape, generator=g) * 0.02 + 0.001)
        if zero is not None:
            zero.copy_((torch.rand(zero.shape, generator=g) - 0.5) * 0.2)
        if stage is not None:
            stage.copy_(torch.randn(stage.shape, generator=g))
    return pool.layer(0) if layers == 1 else pool


@pytest.mark.parametrize("D,Hq,H,ps", [(64, 9, 3, 16), (96, 4, 4, 32), (32, 8, 2, 16), (128, 2, 1, 16)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kv", KV)
def test_attention_decode_and_prefill_chunks(lib, D, Hq, H, ps, window, kv):
    """A step of a decode row (long context), a prefill chunk after a cached prefix and a whole prompt, pages out
    of order, over pages full of other sequences' values; float32, float16, int8 (codes times their scale a token
    and head) or int4 pages (codes times their group's scale, plus its zero), keys and values each their own."""
    g = torch.Generator().manual_seed(D + Hq + window)
    layer = _pool(D, H, ps, 24, g, kv)
    lens, rows = [37, 20, 7], [1, 6, 7]
    perm = torch.randperm(24, generator=g).to(torch.int32)
    page_table = torch.stack([perm[0:8], perm[8:16], perm[16:24]])
    q_starts = torch.tensor([0, 1, 7, 14], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(rows), Hq, D, generator=g)
    out = cpu.attention(q, layer, page_table, seq_lens, q_starts, 0.125, window, lib=lib)
    want = paged_attention_ref(q, layer, page_table, seq_lens, q_starts, 0.125, window)
    assert (out - want).abs().max().item() < 1e-5


# (D, Hq, H): the default model's heads; a head width that is not a multiple of 32 (the value tiles' tail) and a
# group of one; an odd group (an odd query count a block); a width that is not a multiple of 8 (the per-row tasks)
@pytest.mark.parametrize("D,Hq,H", [(64, 9, 3), (40, 4, 4), (32, 5, 1), (36, 2, 1)])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("kv", KV)
def test_prefill_steps_take_the_tiles_and_match(lib, D, Hq, H, window, kv):
    """From cpu_kernels.c's TILE_ROWS rows on, blocks of rows and chunks of positions: a decode row beside a
    prefill chunk after a cached prefix (blocks of rows past the first) and a whole prompt, pages out of order."""
    g = torch.Generator().manual_seed(D * Hq + window)
    ps = 16
    layer = _pool(D, H, ps, 40, g, kv)
    lens, rows = [150, 110, 70], [1, 40, 70]
    perm = torch.randperm(40, generator=g).to(torch.int32)
    page_table = torch.stack([perm[0:10], perm[10:20], perm[20:30]])
    q_starts = torch.tensor([0, 1, 41, 111], dtype=torch.int32)
    q = torch.randn(sum(rows), Hq, D, generator=g)
    out = cpu.attention(q, layer, page_table, torch.tensor(lens, dtype=torch.int32), q_starts, D ** -0.5, window,
                        lib=lib)
    want = paged_attention_ref(q, layer, page_table, torch.tensor(lens, dtype=torch.int32), q_starts, D ** -0.5,
                               window)
    assert (out - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("kv", KV)
def test_a_decode_row_cut_into_parts_and_merged(lib, window, kv):
    """A decode row of one key head over a long context leaves the threads too few tasks, so its positions are cut
    into parts (a part's max, sum and outputs, merged after): the same attention as the reference."""
    g = torch.Generator().manual_seed(17 + window)
    layer = _pool(64, 1, 16, 12, g, kv)
    q = torch.randn(1, 4, 64, generator=g)
    args = (layer, torch.randperm(12, generator=g).to(torch.int32)[None], torch.tensor([181], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.125, window)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # eight parts wanted: two tasks for each of four threads
    try:
        out = cpu.attention(q, *args, lib=lib)
    finally:
        torch.set_num_threads(threads)
    assert (out - paged_attention_ref(q, *args)).abs().max().item() < 1e-5


@pytest.mark.parametrize("D,Hq,H", [(64, 9, 3), (40, 4, 1)])
@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("threads", [1, 4])
def test_a_sequences_rows_are_each_its_decode_row_bit_for_bit(lib, D, Hq, H, window, kv, threads):
    """1 to 14 rows of one sequence (a verification step: the decode row and the drafted tokens after it; 15 rows
    in all, below TILE_ROWS, where prefill's tiles take over), beside another sequence's decode row, walk the
    sequence's keys once together: each row's output is what the row alone gives in a decode step (the same step's
    other sequence beside it) bit for bit, and the reference's; positions that are not multiples of the page size,
    pages out of order. Four threads cut the rows' positions into parts (one key head: too few tasks), as they cut
    the decode row's."""
    g = torch.Generator().manual_seed(D + Hq + window + threads)
    ps = 16
    layer = _pool(D, H, ps, 30, g, kv)
    perm = torch.randperm(30, generator=g).to(torch.int32)
    page_table = torch.stack([perm[0:15], perm[15:30]])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in range(1, 15):
            n = 150 + 3 * r  # the sequence's length with its r rows: its rows at positions n - r .. n - 1
            q = torch.randn(1 + r, Hq, D, generator=g)
            args = (layer, page_table, torch.tensor([70, n], dtype=torch.int32),
                    torch.tensor([0, 1, 1 + r], dtype=torch.int32), D ** -0.5, window)
            out = cpu.attention(q, *args, lib=lib)
            assert (out - paged_attention_ref(q, *args)).abs().max().item() < 1e-5, r
            for i in range(r):
                alone = cpu.attention(q[[0, 1 + i]], layer, page_table,
                                      torch.tensor([70, n - r + i + 1], dtype=torch.int32),
                                      torch.tensor([0, 1, 2], dtype=torch.int32), D ** -0.5, window, lib=lib)
                assert torch.equal(out[1 + i], alone[1]), (r, i)
            assert torch.equal(out[0], alone[0]), r
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv", ["int8", "int4", "int8/int4", "int4ch", "int4ch/int4"])
def test_attention_over_codes_is_attention_over_their_values_bit_for_bit(lib, kv):
    """Codes are turned into floats exactly as formats.dequantize_kv turns them (int4 and int4ch: a product, then a
    sum, not one fused multiply-add; int4ch's scale and zero its page's, head's and channel's), so attention over
    int8/int4/int4ch pages is attention over float32 pages holding their values, bit for bit: decode rows, and a
    prefill chunk past cpu_kernels.c's TILE_ROWS (the tiles)."""
    g = torch.Generator().manual_seed(29)
    layer = _pool(64, 3, 16, 24, g, kv)
    floats = new_kv_pool("fp32", 1, 24, 16, 3, 64, torch.float32, "cpu").layer(0)
    for side, (data, scale, zero, fmt) in zip((floats.k, floats.v), (
            (layer.k, layer.k_scale, layer.k_zero, layer.k_format), (layer.v, layer.v_scale, layer.v_zero,
                                                                     layer.v_format))):
        side.copy_(dequantize_kv(data, scale, zero, fmt, torch.float32))
    page_table = torch.randperm(24, generator=g).to(torch.int32).view(3, 8)
    seq_lens = torch.tensor([101, 60, 40], dtype=torch.int32)
    q_starts = torch.tensor([0, 1, 2, 42], dtype=torch.int32)
    q = torch.randn(42, 9, 64, generator=g)
    args = (page_table, seq_lens, q_starts, 0.125)
    assert torch.equal(cpu.attention(q, layer, *args, lib=lib), cpu.attention(q, floats, *args, lib=lib))


def test_attention_of_strided_queries(lib):
    """Queries as a view of the qkv rows (row stride past the query heads), as the model passes them."""
    g = torch.Generator().manual_seed(2)
    layer = _pool(64, 3, 16, 4, g)
    qkv = torch.randn(2, (9 + 6) * 64, generator=g)
    q = qkv.view(2, 15, 64)[:, :9]
    args = (layer, torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32), 0.125)
    assert (cpu.attention(q, *args, lib=lib) - paged_attention_ref(q, *args)).abs().max().item() < 1e-5


@pytest.mark.parametrize("D,Hq,H,T", [(64, 9, 3, 5), (96, 4, 2, 1), (32, 2, 2, 17)])
@pytest.mark.parametrize("kv", [f for f in KV if f not in STAGED])
def test_rope_write_matches_the_reference(lib, D, Hq, H, T, kv):
    """The rotated keys and the values written into float32 pages, or rounded to float16, to int8 codes and their
    scale a head, or to int4 codes and their scale and zero a group, as torch rounds them (the values bit for bit;
    the keys, rotated in another order of float operations, within a code where a rotated value lies near a
    rounding boundary)."""
    g = torch.Generator().manual_seed(T)
    ps = 16
    want_layer, got_layer = _pool(D, H, ps, 4, g, kv), _pool(D, H, ps, 4, g, kv)
    got_layer.k.copy_(want_layer.k), got_layer.v.copy_(want_layer.v)
    qkv = torch.randn(T, (Hq + 2 * H) * D, generator=g)
    angles = torch.rand(T, D // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(4 * ps, generator=g)[:T]
    for name in ("k_scale", "v_scale", "k_zero", "v_zero"):
        if getattr(want_layer, name) is not None:
            getattr(got_layer, name).copy_(getattr(want_layer, name))
    want_q = rope_write_kv_ref(qkv.clone(), cos, sin, want_layer, slots, Hq, H)
    got_q = cpu.rope_write(qkv, cos, sin, got_layer, slots, Hq, H, lib=lib)
    assert (got_q - want_q).abs().max().item() < 1e-5
    k_fmt, v_fmt = kv_formats(kv)
    keys = [dequantize_kv(layer.k, layer.k_scale, layer.k_zero, k_fmt, torch.float32) for layer in (got_layer,
                                                                                                   want_layer)]
    one_code = 1e-5 if k_fmt in ("fp32", "fp16") else 1.01 * want_layer.k_scale.float().max().item()
    assert (keys[0] - keys[1]).abs().max().item() <= one_code
    for name in ("v", "v_scale", "v_zero"):
        if getattr(want_layer, name) is not None:
            assert torch.equal(getattr(got_layer, name), getattr(want_layer, name)), name


def _qkv_step(g, T, Hq, H, D):
    """T rows of qkv and their rotations."""
    angles = torch.rand(T, D // 2, generator=g) * 6
    return torch.randn(T, (Hq + 2 * H) * D, generator=g), angles.cos(), angles.sin()


@pytest.mark.parametrize("D,Hq,H", [(64, 9, 3), (32, 4, 2)])
@pytest.mark.parametrize("kv", STAGED)
def test_int4ch_writes_round_each_open_page_as_the_reference(lib, D, Hq, H, kv):
    """int4ch pages written as dispatch._write_pages_ref writes them: each write stages the token (unless it fills
    its page, which is then final) and rounds its page again over its tokens so far, from their staged values, to a
    scale and zero a channel; decode writes a token at a time for two sequences, then a chunk of one sequence that
    fills a page and opens the next. Codes, scales and zeros bit for bit the reference's (the keys as rotated by the
    same code: both sides are given the reference's rotated rows), the stage too."""
    g = torch.Generator().manual_seed(D + H)
    ps = 16
    want, got = (new_kv_pool(kv, 1, 6, ps, H, D, torch.float32, "cpu", stage_rows=2) for _ in range(2))
    tables = [[4, 1, 5], [2, 0]]

    def write(seq, positions):
        qkv, cos, sin = _qkv_step(g, len(positions), Hq, H, D)
        slots = torch.tensor([tables[seq][p // ps] * ps + p % ps for p in positions])
        stage = torch.tensor([seq * ps + p % ps for p in positions])
        flat = torch.ones(len(positions), D // 2), torch.zeros(len(positions), D // 2)  # rows rotated already
        rotated = qkv.clone()
        rope_write_kv_ref(rotated, cos, sin, want.layer(0), slots, Hq, H, stage)
        cpu.rope_write(rotated.clone(), *flat, got.layer(0), slots, Hq, H, stage, lib=lib)

    for p in range(20):  # two sequences decoding, a token a step each
        write(0, [p])
        if p < 11:
            write(1, [p])
    write(1, list(range(11, 21)))  # a chunk: offsets 11-15 (the last fills page 2), then 0-4 of page 0
    write(0, list(range(20, 36)))  # past two page boundaries
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        if getattr(want, name) is not None:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    # the stage of each open page (sequence b's in its row b; rows past them are never read: a page filled in a
    # step is final, and a page's earlier tokens are staged before a later one is read)
    for stage in ("k_stage", "v_stage"):
        if getattr(want, stage) is not None:
            for b, n in enumerate((36, 21)):
                rows = slice(b * ps, b * ps + n % ps)
                assert torch.equal(getattr(got, stage)[0, rows], getattr(want, stage)[0, rows]), (stage, b)


@pytest.mark.parametrize("kv", STAGED)
@pytest.mark.parametrize("threads", [1, 4])
def test_int4ch_rows_see_their_open_page_as_their_decode_steps_did(lib, kv, threads):
    """A sequence's few rows over int4ch pages (a verification step: the decode row and the drafted tokens after
    it, beside another sequence's decode row): the step's write rounds the open page over all its rows' keys, but
    each row before the last is attended to over its page rounded up to its own token, from the stage, as its
    decode step saw it (own_page in cpu_kernels.c, kvcache.dispatch._as_decode_page): each row's output is bit for
    bit what the same tokens written and attended a step at a time give, near the reference's, and the pages end
    the same. Rows from offsets 9 (all in one page) and 15 (the first row fills its page, the rest open the next:
    as written, then their own)."""
    g = torch.Generator().manual_seed(5 + threads)
    D, Hq, H, ps = 64, 9, 3, 16
    perm = torch.randperm(30, generator=g).to(torch.int32)
    page_table = torch.stack([perm[0:15], perm[15:30]])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for start, r in ((9 + 16 * 9, 6), (15 + 16 * 9, 5)):
            steps, batch = (_pool(D, H, ps, 30, torch.Generator().manual_seed(start), kv, stage_rows=2)
                            for _ in range(2))
            qkv, cos, sin = _qkv_step(g, r, Hq, H, D)
            other_q = torch.randn(1, Hq, D, generator=g)
            pos = list(range(start, start + r))
            slots = torch.tensor([int(page_table[1, p // ps]) * ps + p % ps for p in pos])
            stage = torch.tensor([ps + p % ps for p in pos])  # stage row 1
            other_stage = torch.tensor([70 % ps])

            alone = []
            for i in range(r):  # a decode step a token
                q = cpu.rope_write(qkv[i:i + 1].clone(), cos[i:i + 1], sin[i:i + 1], steps, slots[i:i + 1], Hq, H,
                                   stage[i:i + 1], lib=lib)
                out = cpu.attention(torch.cat([other_q, q]), steps, page_table,
                                    torch.tensor([71, start + i + 1], dtype=torch.int32),
                                    torch.tensor([0, 1, 2], dtype=torch.int32), D ** -0.5, 0,
                                    torch.cat([other_stage, stage[i:i + 1]]), lib=lib)
                alone.append(out[1])
            q = cpu.rope_write(qkv.clone(), cos, sin, batch, slots, Hq, H, stage, lib=lib)  # the verification
            args = (batch, page_table, torch.tensor([71, start + r], dtype=torch.int32),
                    torch.tensor([0, 1, 1 + r], dtype=torch.int32), D ** -0.5, 0, torch.cat([other_stage, stage]))
            out = cpu.attention(torch.cat([other_q, q]), *args, lib=lib)
            for i in range(r):
                assert torch.equal(out[1 + i], alone[i]), (start, i)
            assert (out - paged_attention_ref(torch.cat([other_q, q]), *args)).abs().max().item() < 1e-5
            for name in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero", "k_stage", "v_stage"):
                if getattr(steps, name) is not None:
                    assert torch.equal(getattr(batch, name), getattr(steps, name)), name
    finally:
        torch.set_num_threads(before)


def test_int4ch_writes_without_stage_slots_are_an_error(lib):
    """An int4ch side rounds its open page from the stage: a write without the tokens' stage slots, or with one
    outside the stage or at another offset than its slot's, is a LocalpdError and writes nothing."""
    from localpd.errors import LocalpdError

    g = torch.Generator().manual_seed(8)
    layer = _pool(64, 3, 16, 4, g, "int4ch/int4")
    before = layer.k.clone()
    qkv, cos, sin = _qkv_step(g, 1, 9, 3, 64)
    for stage in (None, torch.tensor([16]), torch.tensor([4])):
        with pytest.raises(LocalpdError, match="outside the KV pool"):
            cpu.rope_write(qkv.clone(), cos, sin, layer, torch.tensor([5]), 9, 3, stage, lib=lib)
    assert torch.equal(layer.k, before)


def test_int8_pages_round_by_division_as_torch_does(lib):
    """The int8 write divides by the scale, as formats.quantize_kv does, where the file's -freciprocal-math would
    multiply by its rounded reciprocal: a value whose quotient by a head's scale (0.005001068, its amax 127 times
    that) lies just under 1.5 takes code 1, where the product with the reciprocal rounds to 2."""
    scale, x = 0.005001068115234375, 0.007501601707190275
    g = torch.Generator().manual_seed(4)
    ps, D = 16, 64
    want_layer, got_layer = _pool(D, 1, ps, 2, g, "int8"), _pool(D, 1, ps, 2, g, "int8")
    qkv = torch.randn(1, 3 * D, generator=g)
    qkv[0, 2 * D:] = (torch.rand(D, generator=g) - 0.5) * 0.5
    qkv[0, 2 * D], qkv[0, 2 * D + 1] = 127 * scale, x
    cos, sin, slots = torch.ones(1, D // 2), torch.zeros(1, D // 2), torch.tensor([5])
    rope_write_kv_ref(qkv.clone(), cos, sin, want_layer, slots, 1, 1)
    cpu.rope_write(qkv, cos, sin, got_layer, slots, 1, 1, lib=lib)
    assert want_layer.v_scale[0, 5, 0, 0].item() == scale and int(want_layer.v[0, 5, 0, 1]) == 1
    assert torch.equal(got_layer.v[0, 5], want_layer.v[0, 5])
    assert torch.equal(got_layer.v_scale[0, 5], want_layer.v_scale[0, 5])


def test_the_app_takes_the_kernels_on_the_cpu_and_says_which():
    """On this machine (a C compiler is part of the test setup) the CPU kernels are built and describe() names
    the instruction set; a product they cannot take (bf16 input, a width not in blocks of 32) goes to the
    reference."""
    assert cpu.unavailable() is None
    assert "localpd kernels" in cpu.describe()
    tiny = sys.float_info.min
    assert tiny / 2 > 0 and tiny / 2 * 2 == tiny  # loading them left the process's floats IEEE (no flush-to-zero)
    w = Int4Weight.quantize_rtn(torch.randn(8, 64), 32)
    assert cpu.takes_linear(torch.randn(1, 64), w, None, None)
    assert not cpu.takes_linear(torch.randn(1, 64, dtype=torch.bfloat16), w, None, None)
    w8 = Int8Weight(torch.ones(4, 40, dtype=torch.int8), torch.ones(4, 5, dtype=torch.float16))
    assert not cpu.takes_linear(torch.randn(1, 40), w8, None, None)


def test_tables_outside_the_pool_are_an_error_not_a_crash(lib):
    """A page index past the pool, a sequence longer than its page table, or a slot past the pool: a LocalpdError,
    and nothing written, where the kernels would otherwise read or write outside the pages."""
    from localpd.errors import LocalpdError

    g = torch.Generator().manual_seed(4)
    layer = _pool(64, 3, 16, 4, g)
    q = torch.randn(1, 9, 64, generator=g)
    one, starts = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(LocalpdError, match="outside the KV pool"):
        cpu.attention(q, layer, torch.tensor([[7]], dtype=torch.int32), one, starts, 0.125, lib=lib)
    with pytest.raises(LocalpdError, match="outside the KV pool"):
        cpu.attention(q, layer, torch.tensor([[0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                      starts, 0.125, lib=lib)
    before = layer.k.clone()
    qkv = torch.randn(2, 15 * 64, generator=g)
    angles = torch.rand(2, 32, generator=g)
    with pytest.raises(LocalpdError, match="outside the KV pool"):
        cpu.rope_write(qkv, angles.cos(), angles.sin(), layer, torch.tensor([3, 64]), 9, 3, lib=lib)
    assert torch.equal(layer.k, before)


@pytest.mark.parametrize("kv", KV)
def test_decode_layers_in_one_call_equal_the_kernels_op_by_op(lib, kv):
    """lpd_decode_layers runs six layers (int4, int8 and per-row int8 weights, int4-k, a codebook, and 5-bit int4-k
    (Q5_K) with qkv in three parts of different formats, as a GGUF's Q4_K q and k beside a Q5_0 or Q6_K v; an odd block count in down, RoPE of the
    step, the local one with a sliding window, none) over two sequences (a decode row and a three-row chunk whose
    first row fills a page and whose second opens the next, pages out of order) in one parallel region: the same
    floats, KV writes (int4ch's stage too) and residual stream as the kernels called one by one."""
    from types import SimpleNamespace

    from localpd.kernels.dispatch import PreNorm

    g = torch.Generator().manual_seed(11)
    Hq, H, D, dim, ffn, ps, eps = 4, 2, 16, 64, 96, 8, 1e-5
    kinds = [("int4", 32), ("int8", 32), ("int8", None), ("int4k", 32), ("iq4", 32), ("int5k", 32)]
    ropes, windows = [0, 1, 2, 0, 0, 0], [0, 5, 0, 0, 3, 0]
    layers = []
    for kind, group in kinds:
        lin = [SimpleNamespace(weight=weights(kind, n, k, group or k, g), bias=None)
               for n, k in [((Hq + 2 * H) * D, dim), (dim, Hq * D), (2 * ffn, dim), (dim, ffn)]]
        layers.append((lin, torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5))
    lin[0] = SimpleNamespace(parts=[SimpleNamespace(weight=weights(kind, n, dim, 32, g), bias=b)  # the last layer's
                                    for kind, n, b in (("int4k", Hq * D, None), ("int5", H * D, None),
                                                       ("int8", H * D, torch.randn(H * D, generator=g)))])

    def qkv_of(lin, x, residual, norm):
        parts = [cpu.linear(x, p.weight, p.bias, None, PreNorm(residual, norm, eps), lib=lib)
                 for p in getattr(lin, "parts", [lin])]
        return torch.cat([y for y, _ in parts], dim=-1), parts[0][1]
    pool = _pool(D, H, ps, 8, g, kv, layers=len(kinds), stage_rows=2)
    other = new_kv_pool(kv, len(kinds), 8, ps, H, D, torch.float32, "cpu", stage_rows=2)
    sides = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "k_stage", "v_stage")
    for name in sides:
        if getattr(pool, name) is not None:
            getattr(other, name).copy_(getattr(pool, name))
    page_table = torch.tensor([[5, 2, 7], [0, 3, 0]], dtype=torch.int32)
    seq_lens, q_starts = torch.tensor([20, 10], dtype=torch.int32), torch.tensor([0, 1, 4], dtype=torch.int32)
    seqs, positions, T = [0, 1, 1, 1], [19, 7, 8, 9], 4
    slots = torch.tensor([int(page_table[b, p // ps]) * ps + p % ps for b, p in zip(seqs, positions)])
    stage_slots = torch.tensor([b * ps + p % ps for b, p in zip(seqs, positions)])  # stage row b: sequence b's
    rotations = [((a := torch.rand(T, D // 2, generator=g) * 6).cos(), a.sin()) for _ in range(2)]
    emb = torch.randn(T, dim, generator=g)

    out, x = emb.clone(), None  # op by op
    for li, ((qkv_l, o_l, gu_l, down_l), attn_norm, mlp_norm) in enumerate(layers):
        layer = pool.layer(li)
        qkv, x = qkv_of(qkv_l, out, x, attn_norm)
        cos, sin = rotations[ropes[li]] if ropes[li] < 2 else (torch.ones(T, D // 2), torch.zeros(T, D // 2))
        q = cpu.rope_write(qkv, cos, sin, layer, slots, Hq, H, stage_slots, lib=lib)
        attn = cpu.attention(q, layer, page_table, seq_lens, q_starts, 0.25, windows[li], stage_slots, lib=lib)
        out = cpu.linear(attn.reshape(T, Hq * D), o_l.weight, lib=lib)
        gate_up, x = cpu.linear(out, gu_l.weight, None, None, PreNorm(x, mlp_norm, eps), lib=lib)
        out = cpu.linear(gate_up, down_l.weight, None, "silu", lib=lib)

    plans = (cpu.LayerPlan * len(layers))(*[cpu.layer_plan(lin, an, mn, Hq, H, D, "silu", eps)
                                            for lin, an, mn in layers])
    caches = cpu.layer_caches([other.layer(i) for i in range(len(kinds))], windows, ropes)
    got, got_x = emb.clone(), torch.empty(T, dim)
    scratch = (torch.empty(T, (Hq + 2 * H) * D), torch.empty(T, Hq * D), torch.empty(T, 2 * ffn))
    cpu.decode_layers(plans, caches, got, got_x, False, scratch, rotations, ps, 8, slots, page_table, seq_lens,
                      q_starts, 0.25, stage_slots, lib=lib)
    assert torch.equal(got, out) and torch.equal(got_x, x)
    assert all(getattr(pool, n) is None or torch.equal(getattr(other, n), getattr(pool, n)) for n in sides)


def test_gathered_weights_view_one_buffer_and_multiply_the_same():
    """gather_weights moves int4 and int8 weights (one listed twice) into one buffer, 2 MiB-aligned; the products
    after the move (whose plans were made before it) equal those before, bit for bit."""
    g = torch.Generator().manual_seed(8)
    ws = [weights("int4", 96, 576, 32, g), weights("int8", 64, 160, 32, g), weights("int4k", 40, 320, 32, g),
          weights("iq4", 24, 96, 32, g), weights("int5k", 16, 256, 32, g)]
    x = [torch.randn(1, w.shape[1], generator=g) for w in ws]
    before = [cpu.linear(xi, w) for xi, w in zip(x, ws)]
    moved = cpu.gather_weights(ws + ws[:1])
    assert moved >= sum(w.nbytes for w in ws)
    tensors = [ws[0].packed, ws[0].scales, ws[0].biases, ws[1].data, ws[1].scales, ws[2].packed, ws[2].d,
               ws[2].dmin, ws[2].sub, ws[3].packed, ws[3].scales, ws[4].packed, ws[4].fifth, ws[4].sub]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert ws[0].packed.data_ptr() % cpu.HUGE_PAGE == 0
    assert all(torch.equal(cpu.linear(xi, w), b) for xi, w, b in zip(x, ws, before))


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None), ("int4k", 32),
                                        ("int5", 32), ("int5k", 32), ("iq4", 32), ("mxfp4", 32)])
@pytest.mark.parametrize("n,k", [(70, 576), (64, 1536), (33, 96), (33, 192)])
def test_each_of_a_few_rows_is_its_one_row_product_bit_for_bit(lib, kind, group, n, k):
    """2 to 15 rows (a verification step's: a decode row and the drafted tokens after it; on AVX-512 one tile of all
    the rows a weight row) give each row exactly what that row alone gives (the decode step's one-row product), so speculative
    decoding's rows are the plain decode rows they check. (AVX2's int4-k differs in the last bits between one row
    and several: not held there.)"""
    if kind in ("int4k", "int5k") and lib.lpd_isa().decode() == "avx2":
        pytest.skip("AVX2's int4-k factors are not gemv4's for one row")
    if group and k % group:
        pytest.skip(f"groups of {group} do not divide {k}")
    group = k if group is None else group
    g = torch.Generator().manual_seed(n + k)
    w = weights(kind, n, k, group, g)
    x = torch.randn(15, k, generator=g) * 3
    bias = torch.randn(n, generator=g)
    alone = torch.cat([cpu.linear(x[i:i + 1], w, bias, lib=lib) for i in range(15)])
    for m in (2, 3, 4, 5, 8, 9, 12, 15):
        assert torch.equal(cpu.linear(x[:m], w, bias, lib=lib), alone[:m]), m


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None), ("int4k", 32),
                                        ("int5", 32), ("int5k", 32), ("iq4", 32), ("mxfp4", 32)])
def test_the_integer_products_at_prefill_rows_are_each_its_one_row_product(lib, kind, group, monkeypatch):
    """Past GEMM_ROWS too (the float products' range: 16, 37 and 64 rows through lpd_linear), each row's integer
    product is its decode row's bit for bit and the torch reference's on the rounded input: the tiles could take
    prefill without changing any row. (AVX2's int4-k: as above.)"""
    if kind in ("int4k", "int5k") and lib.lpd_isa().decode() == "avx2":
        pytest.skip("AVX2's int4-k factors are not gemv4's for one row")
    monkeypatch.setattr(cpu, "GEMM_ROWS", 1 << 20)
    n, k = 61, 576
    group = k if group is None else group
    g = torch.Generator().manual_seed(7)
    w = weights(kind, n, k, group, g)
    x, bias = torch.randn(64, k, generator=g) * 3, torch.randn(n, generator=g)
    alone = torch.cat([cpu.linear(x[i:i + 1], w, bias, lib=lib) for i in range(64)])
    for m in (16, 37, 64):
        y = cpu.linear(x[:m], w, bias, lib=lib)
        assert torch.equal(y, alone[:m]), m
        assert rel_err(y, ref(w, rounded_rows(x[:m]), bias)) < 2e-5


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 64), ("int8", None), ("int8", 32), ("int4k", 32),
                                        ("int5", 32), ("int5k", 32), ("iq4", 32)])
@pytest.mark.parametrize("n,k", [(61, 576), (33, 96), (23, 1536)])
def test_every_row_count_to_17_is_each_rows_one_row_product_and_the_references(lib, kind, group, n, k, monkeypatch):
    """Every row count from 1 to 17 through the integer products (a verification step's 1 to 15 rows, and past
    them: 16 and 17 take AVX-512's tiles of four weight rows and four input rows, 2 to 15 one tile of all the rows
    a weight row), fresh random inputs for each count: each row bit for bit its one-row product, and all of them
    within float summation of the torch reference on the rounded input. Odd weight-row counts, an odd block count
    (K = 96: AVX-512's plain loops) and groups of several blocks (int4 g64: row_factors' general path, its rows in
    two calls past eight). (AVX2's int4-k: as above.)"""
    if kind in ("int4k", "int5k") and lib.lpd_isa().decode() == "avx2":
        pytest.skip("AVX2's int4-k factors are not gemv4's for one row")
    if group and k % group:
        pytest.skip(f"groups of {group} do not divide {k}")
    monkeypatch.setattr(cpu, "GEMM_ROWS", 1 << 20)
    group = k if group is None else group
    g = torch.Generator().manual_seed(n * k + group)
    w = weights(kind, n, k, group, g)
    bias = torch.randn(n, generator=g)
    for m in range(1, 18):
        x = torch.randn(m, k, generator=g) * 3
        y = cpu.linear(x, w, bias, lib=lib)
        assert torch.equal(y, torch.cat([cpu.linear(x[i:i + 1], w, bias, lib=lib) for i in range(m)])), m
        assert rel_err(y, ref(w, rounded_rows(x), bias)) < 2e-5, m


@pytest.mark.parametrize("kind", list(CODEBOOKS))
@pytest.mark.parametrize("m,n,k", [(1, 70, 576), (1, 33, 96), (3, 61, 1536), (5, 17, 32), (40, 200, 576)])
def test_a_codebook_weight_multiplies_as_its_values_held_as_int8_bit_for_bit(lib, kind, m, n, k):
    """Codes looked up in registers give the products of the same values stored as int8 bytes (as IQ4_NL, IQ4_XS and
    MXFP4 were held before), in the same lanes and order: the same floats, decode rows (an odd last block too) and
    prefill rows alike, at 4.5 bits a weight where int8 takes 8.5."""
    g = torch.Generator().manual_seed(m + n + k)
    w = weights(kind, n, k, 32, g)
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    assert torch.equal(cpu.linear(x, w, bias, lib=lib), cpu.linear(x, as_int8(w), bias, lib=lib))
    assert w.nbytes * 8 / (n * k) == 4.5


@pytest.mark.parametrize("kind", ["int5", "int5k"])
@pytest.mark.parametrize("m,n,k", [(1, 70, 576), (1, 33, 96), (3, 61, 1536), (40, 200, 576)])
def test_a_5_bit_weight_without_fifth_bits_multiplies_as_its_int4_weight_bit_for_bit(lib, kind, m, n, k):
    """The fifth bits are all that a 5-bit weight adds to its int4 weight (int4-g32's, int4-k's): with every one of
    them clear, decode and prefill rows give that int4 weight's floats exactly; with them set, the products move
    (each row by the weight's 16 x scale x input sums) and hold to the reference."""
    g = torch.Generator().manual_seed(m + n + k)
    w = weights(kind, n, k, 32, g)
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    clear = type(w)(**{**w.__dict__, "fifth": torch.zeros_like(w.fifth)})
    low = Int4Weight(w.packed, w.scales, w.biases) if kind == "int5" else w.low()
    assert torch.equal(cpu.linear(x, clear, bias, lib=lib), cpu.linear(x, low, bias, lib=lib))
    y = cpu.linear(x, w, bias, lib=lib)
    assert rel_err(y, ref(w, rounded_rows(x), bias)) < 2e-5 and rel_err(y, ref(low, rounded_rows(x), bias)) > 1e-2


@pytest.mark.parametrize("kind", ["int6k", "int3k", "int2k"])
@pytest.mark.parametrize("n,k", [(61, 512), (33, 1536), (24, 256)])
def test_q6_k_rows_are_each_their_one_row_product_and_the_references(lib, kind, n, k, monkeypatch):
    """Q6_K (6-bit codes, an int8 scale a sub-block of 16), Q3_K's form of it (nibbles, offset 8) and Q2_K's (nibbles
    0..3 with a minimum a sub-block): every row count
    from 1 to 17 through the integer products (past GEMM_ROWS too), each row bit for bit its one-row product on every
    instruction set, all within float summation of the torch reference on the rounded input; prefill's float GEMM
    over its dequantized rows likewise."""
    g = torch.Generator().manual_seed(n + k)
    w = weights(kind, n, k, 256, g)
    bias = torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g) * 3
    assert rel_err(cpu.linear(x, w, bias, lib=lib), ref(w, rounded_rows(x), bias)) < 2e-5  # dequantize + GEMM
    monkeypatch.setattr(cpu, "GEMM_ROWS", 1 << 20)
    for m in range(1, 18):
        x = torch.randn(m, k, generator=g) * 3
        y = cpu.linear(x, w, bias, lib=lib)
        assert torch.equal(y, torch.cat([cpu.linear(x[i:i + 1], w, bias, lib=lib) for i in range(m)])), m
        assert rel_err(y, ref(w, rounded_rows(x), bias)) < 2e-5, m


@pytest.mark.parametrize("kind", ["int6k", "int3k", "int2k"])
@pytest.mark.parametrize("act", ["silu", None])
def test_q6_k_with_the_norm_or_the_gate_in_front(lib, kind, act):
    g = torch.Generator().manual_seed(12)
    m, n, k = 3, 40, 512
    w = weights(kind, n, k, 256, g)
    if act:
        x = torch.randn(m, 2 * k, generator=g)
        assert rel_err(cpu.linear(x, w, None, act, lib=lib), ref(w, x, gated=act)) < 1e-4
        return
    x, res, nw = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5
    norm = PreNorm(res, nw, 1e-5)
    y, s = cpu.linear(x, w, None, None, norm, lib=lib)
    y_ref, s_ref = ref(w, x, norm=norm)
    assert torch.equal(s, s_ref) and rel_err(y, y_ref) < 1e-4


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int4", 64), ("int5", 32)])
@pytest.mark.parametrize("m", [1, 2, 5, 15, 16, 37])
@pytest.mark.parametrize("path", ["rows", "float_gemm", "integer_gemm"])
def test_a_symmetric_weight_reads_no_biases_and_gives_the_same_floats(lib, kind, group, m, path, monkeypatch):
    """A Q4_0 or Q5_0 file's weight (each bias -8 or -16 times its scale, exactly) goes to the kernels without its
    biases (a tenth fewer bytes a decode step), which work them out from the scales: decode rows, a verification
    step's, prefill's integer products through lpd_linear ("rows") and its dequantized float GEMM give the floats of
    the same weight with its biases passed, bit for bit; prefill's integer GEMM takes the offset off the codes where
    the biases' term is added to the passed weight's, the same value within float32's rounding; and the bytes a step
    counts leave them out."""
    if path != "rows" and m < cpu.GEMM_ROWS:
        pytest.skip("the GEMMs take prefill's rows only")
    if path == "integer_gemm" and not integer_gemm(lib):
        pytest.skip("an AVX512-VNNI build's GEMM")
    if path == "rows":
        monkeypatch.setattr(cpu, "GEMM_ROWS", 1 << 20)
    if path == "float_gemm":
        monkeypatch.setattr(cpu, "integer_prefill", lambda: False)
    g = torch.Generator().manual_seed(m + group)
    n, k = 45, 576
    w = weights(kind, n, k, group, g)
    assert not symmetric(w)
    sym = dataclasses.replace(w, biases=w.scales * type(w).SYMMETRIC_BIAS)
    passed = dataclasses.replace(sym, biases=sym.biases.clone())
    passed.__dict__["_symmetric"] = False  # its plan keeps the biases: the kernels read them as any int4 weight's
    assert symmetric(sym) and cpu.weight_plan(sym).biases is None and cpu.weight_plan(passed).biases is not None
    assert sym.nbytes == passed.nbytes - sym.biases.nbytes
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    y = cpu.linear(x, sym, bias, lib=lib)
    if path == "integer_gemm":
        assert rel_err(y, cpu.linear(x, passed, bias, lib=lib)) < 1e-6
    else:
        assert torch.equal(y, cpu.linear(x, passed, bias, lib=lib))
    assert rel_err(y, ref(passed, x if path == "float_gemm" else rounded_rows(x), bias)) < 1e-4
