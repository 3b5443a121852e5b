"""The GEMV over weights in strips (kernels/gemv_strip.py) and the strips themselves (quant/kmajor.py) against their
torch references, in Triton's interpreter on the CPU (LOCALPD_TEST_DEVICE=cuda runs them on a GPU); its compiled
code: tests/measure/test_predict.py."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.errors import LocalpdError  # noqa: E402
from localpd.kernels import gemv_dp4a as dp, gemv_strip as gs  # noqa: E402
from localpd.kernels.act_round import quantize_act  # noqa: E402
from localpd.kernels.dispatch import PreNorm, kmajor_matmul_ref, linear_kmajor, linear_kstrip  # noqa: E402
from localpd.quant.kmajor import KMajorWeight, KStripInt4, KStripInt8, KStripWeight, to_kmajor, to_strips  # noqa: E402
from localpd.quant.weights import Int4Weight, Int8Weight, cat_rows, take_rows  # noqa: E402
from tests.kernels.test_gemv_dp4a import activations, rel_err, triton_on  # noqa: E402, F401 (an autouse fixture)

SMALL = dict(num_warps=1, rows_a_lane=1)  # 32 strip rows a trip: K of 256 int4 inputs (128 int8) a trip


def quantized(fmt: str, n: int, k: int, group: int | None, seed: int):
    """group 0: one group of all of K (int4), None: int8 per output."""
    group = k if group == 0 else group
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    return Int4Weight.quantize_rtn(w, group) if fmt == "int4" else Int8Weight.quantize(w, group)


def strips(fmt: str, n: int, k: int, group: int | None, seed: int) -> KStripWeight:
    s = to_strips(quantized(fmt, n, k, group, seed))
    return type(s)(s.words.to(DEV), s.factors.to(DEV))


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int4", 0), ("int8", None), ("int8", 64)])
def test_strips_are_the_k_major_words_of_four_outputs(fmt, group):
    """Strip j's row i is the K-major row i of outputs 4j..4j+3 (words and factors), the same matrix dequantized,
    its K-major form given back exactly; rows for an embedding lookup dequantize alone; strips stack along the
    outputs as the row-major weights do; outputs not in whole strips stay K-major."""
    q = quantized(fmt, 24, 256, group, seed=3)
    kw, s = to_kmajor(q), to_strips(q)
    assert isinstance(s, KStripInt4 if fmt == "int4" else KStripInt8) and s.shape == q.shape == kw.shape
    assert s.group == kw.group and s.BITS == kw.BITS and s.nbytes == kw.nbytes
    assert s.words.shape == (6, kw.words.shape[0], 4) and torch.equal(s.words[2, 5], kw.words[5, 8:12])
    assert torch.equal(s.factors[5, -1], kw.factors[-1, 20:24])
    back = s.kmajor()
    assert type(back) is type(kw) and torch.equal(back.words, kw.words) and torch.equal(back.factors, kw.factors)
    assert torch.equal(s.dequantize(), q.dequantize()) and torch.equal(s.codes(), kw.codes())
    rows = torch.tensor([0, 7, 23, 7])
    assert torch.equal(take_rows(s, rows, torch.float32), q.dequantize()[rows])
    other = quantized(fmt, 8, 256, group, seed=4)
    joined = cat_rows([s, to_strips(other)])
    assert torch.equal(joined.dequantize(), torch.cat([q.dequantize(), other.dequantize()]))
    assert isinstance(to_strips(quantized(fmt, 22, 256, group, seed=5)), KMajorWeight)


def test_strips_of_the_wrong_shape_are_refused():
    s = to_strips(quantized("int4", 8, 256, 64, seed=1))
    with pytest.raises(LocalpdError, match="strip words"):
        KStripInt4(s.words.reshape(2, -1, 8), s.factors)
    with pytest.raises(LocalpdError, match="do not fit"):
        KStripInt4(s.words, s.factors[:, :3])


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int4", 0), ("int8", None), ("int8", 64)])
@pytest.mark.parametrize("n,k,m,tile", [(200, 256, 1, None), (132, 576, 3, None), (72, 1024, 5, SMALL),
                                        (40, 384, 16, dict(SMALL, PREFETCH=0)), (8, 2048, 2, None),
                                        (48, 768, 1, gs.WIDE_TILE), (40, 512, 1, gs.WIDE_TILE)])
def test_gemv_matches_the_reference(fmt, group, n, k, m, tile):
    """Strip rows past the last whole trip (K of 256 and 576 inputs at 256 rows a trip; 384 at 32), K in several whole
    trips (1024 at 32 rows a trip; 2048 int4 in one of 256), groups of one block, of four and of all of K (int4's,
    and int8's per output), programs of 4 strips (WIDE_TILE; 40 outputs are not whole programs of 16, so 1 strip a
    program of 4 warps), 1-16 rows (programs of 4 and a padded one), the next trip's words loaded ahead or not, a
    bias: the product is the rounded activations times the dequantized weights (float64 reference) to float32
    rounding, and within the rounding's 15 bits of the exact product."""
    if group and k % group:
        group = 32
    s = strips(fmt, n, k, group, seed=n + k)
    x, bias = activations(m, k, seed=k), torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEV)
    y = gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group, bias=bias, tile=tile)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert rel_err(y, gs.gemv_strip_ref(x, s.words, s.factors, s.BITS, s.group, bias=bias)) < 1e-6
    assert rel_err(y, kmajor_matmul_ref(x, s, bias)) < 1e-4
    assert rel_err(y, kmajor_matmul_ref(x, s)) > 1e-3  # the bias counts
    q, sq = quantize_act(x, s.BITS)
    poisoned = torch.full_like(y, float("nan"))  # every output written, by the launch the model makes
    assert torch.equal(gs.gemv_strip_rounded(q, sq, poisoned, s.words, s.factors, s.BITS, s.group, bias=bias,
                                             tile=tile), y)


@pytest.mark.parametrize("m,rows", [(2, (0, 1)), (5, range(5)), (16, (3, 12))])
def test_rows_sharing_a_program_are_each_rows_own_product(m, rows):
    """Up to 4 rows share a program's words (2 exactly; 5 in a full program and a padded one; 16, MAX_ROWS, in
    four programs): each row's output is bit for bit what the row alone gives."""
    s = strips("int4", 40, 512, 64, seed=m)
    x = activations(m, 512, seed=m + 1)
    y = gs.gemv_strip(x, s.words, s.factors, 4, 64, tile=SMALL)
    for r in rows:
        assert torch.equal(y[r:r + 1], gs.gemv_strip(x[r:r + 1], s.words, s.factors, 4, 64, tile=SMALL)), r


def test_words_loaded_ahead_or_not_leave_the_product_bit_for_bit():
    """PREFETCH (0-2 trips ahead, the last trips loading their own again) changes when a trip's words and factors
    are loaded, not a sum: bit for bit, over 4 whole trips and over 2 and a tail; the lanes of a trip set the order
    of the float sums, so other tiles agree to float32 rounding."""
    for fmt, group, n, k in (("int4", 128, 24, 1024), ("int8", None, 16, 512), ("int4", 64, 8, 576)):
        s = strips(fmt, n, k, group, seed=k)
        x = activations(3, k, seed=n)
        y = gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group, tile=SMALL)
        for ahead in (0, 2):
            assert torch.equal(y, gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group,
                                                tile=dict(SMALL, PREFETCH=ahead)))
        for tile in (None, dict(num_warps=2, rows_a_lane=4)):
            assert rel_err(gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group, tile=tile), y) < 1e-6


def test_two_strips_a_program_give_the_same_products():
    """strips=2: a program takes 8 outputs (two strips, each lane's activations serving both), where the strips
    divide in pairs (else one a program): the same product as one strip a program, with a tail trip, several whole
    trips, a bias and up to 4 rows."""
    for fmt, group, n, k, m in (("int4", 64, 40, 576, 1), ("int8", None, 24, 512, 3), ("int4", 0, 12, 256, 2)):
        s = strips(fmt, n, k, group, seed=n)
        x, bias = activations(m, k, seed=k), torch.randn(n, generator=torch.Generator().manual_seed(k)).to(DEV)
        one = gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group, bias=bias, tile=SMALL)
        two = gs.gemv_strip(x, s.words, s.factors, s.BITS, s.group, bias=bias, tile=dict(SMALL, strips=2))
        assert rel_err(two, one) < 1e-6
        assert rel_err(two, gs.gemv_strip_ref(x, s.words, s.factors, s.BITS, s.group, bias=bias)) < 1e-6


def test_the_product_is_the_integer_gemvs_on_the_same_rounding():
    """The same rounded activations and weights as kernels/gemv_dp4a.py's K-major GEMV: the two products agree to
    float32 rounding (only the order of the float sums differs)."""
    for fmt, group in (("int4", 32), ("int8", None)):
        q = quantized(fmt, 64, 768, group, seed=9)
        s, kw = to_strips(q), to_kmajor(q)
        x = activations(2, 768, seed=10)
        y = gs.gemv_strip(x, s.words.to(DEV), s.factors.to(DEV), s.BITS, s.group)
        assert rel_err(y, dp.gemv_dp4a(x, kw.words.to(DEV), kw.factors.to(DEV), kw.BITS, kw.group)) < 1e-6


def test_the_model_linear_takes_it_for_16_bit_rows_up_to_max_rows():
    """linear_kstrip: up to MAX_ROWS rows of bfloat16 activations through this GEMV, with a plain input rounded in a
    launch of its own, RMSNorm's and SiLU * up's rounded by their kernels (the same products as linear_kmajor's
    integer GEMV gives from the same inputs); float32 activations through linear_kmajor over the K-major copy (the
    float GEMV); more rows (prefill) dequantized from the strips for cuBLAS, bit for bit linear_kmajor's."""
    q = quantized("int4", 96, 256, 128, seed=5)
    s, kw = to_strips(q), to_kmajor(q)
    s, kw = type(s)(s.words.to(DEV), s.factors.to(DEV)), type(kw)(kw.words.to(DEV), kw.factors.to(DEV))
    launched = []
    real = gs.gemv_strip_rounded
    gs.gemv_strip_rounded = lambda q, sq, out, *a, **k: launched.append(out.shape[0]) or real(q, sq, out, *a, **k)
    try:
        for m in (gs.MAX_ROWS, gs.MAX_ROWS + 1):
            x = activations(m, 256, seed=m, dtype=torch.bfloat16)
            assert rel_err(linear_kstrip(x, s), linear_kmajor(x, kw)) < 1e-2
    finally:
        gs.gemv_strip_rounded = real
    assert launched == [gs.MAX_ROWS]
    x = activations(2, 256, seed=6, dtype=torch.bfloat16)
    assert torch.equal(linear_kstrip(x, s), gs.gemv_strip(x, s.words, s.factors, 4, 128))
    assert rel_err(linear_kstrip(x, s), linear_kmajor(x, kw)) < 1e-2  # bfloat16 outputs, sums in another order
    x32 = x.float()
    assert torch.equal(linear_kstrip(x32, s), linear_kmajor(x32, kw))
    res = activations(2, 256, seed=7, dtype=torch.bfloat16)
    norm = PreNorm(res, torch.rand(256, generator=torch.Generator().manual_seed(8)).to(DEV).bfloat16() + 0.5, 1e-5)
    (y, h), (y_k, h_k) = linear_kstrip(x, s, norm=norm), linear_kmajor(x, kw, norm=norm)
    assert torch.equal(h, h_k) and rel_err(y, y_k) < 1e-2
    gate_up = activations(2, 512, seed=11, dtype=torch.bfloat16)
    assert rel_err(linear_kstrip(gate_up, s, gated="silu"), linear_kmajor(gate_up, kw, gated="silu")) < 1e-2
    # a prompt's rows: dequantized from the strips, the very matrix (and product) of the K-major path
    x, res = (activations(20, 256, seed=12 + i, dtype=torch.bfloat16) for i in range(2))
    norm = PreNorm(res, norm.weight, 1e-5)
    assert torch.equal(linear_kstrip(x, s), linear_kmajor(x, kw))
    assert all(map(torch.equal, linear_kstrip(x, s, norm=norm), linear_kmajor(x, kw, norm=norm)))
    gate_up = activations(20, 512, seed=14, dtype=torch.bfloat16)
    assert torch.equal(linear_kstrip(gate_up, s, gated="silu"), linear_kmajor(gate_up, kw, gated="silu"))


def test_a_prompts_product_dequantizes_the_strips_a_chunk_of_inputs_at_a_time(monkeypatch):
    """The GEMM path reads strips as it reads K-major words: chunks of inputs (several here) over every strip, the
    same dequantized matrix, so the same product bit for bit."""
    from localpd.kernels import gemv_kmajor as km

    monkeypatch.setattr(km, "DEQUANT_ROWS", 128 * 40)  # 128 inputs of 40 outputs a chunk
    for fmt, group in (("int4", 128), ("int8", None), ("int4", 0)):
        q = quantized(fmt, 40, 640, group, seed=15)
        s, kw = to_strips(q), to_kmajor(q)
        s, kw = type(s)(s.words.to(DEV), s.factors.to(DEV)), type(kw)(kw.words.to(DEV), kw.factors.to(DEV))
        x, bias = activations(12, 640, seed=16), torch.randn(40, generator=torch.Generator().manual_seed(17)).to(DEV)
        y = km.dequant_matmul_kmajor(x, s.words, s.factors, s.BITS, s.group, bias, strips=True)
        assert torch.equal(y, km.dequant_matmul_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, bias))
        assert rel_err(y, kmajor_matmul_ref(x, kw, bias)) < 1e-5


def test_the_layout_is_chosen_per_card_or_by_the_environment(monkeypatch):
    """No card has measured this GEMV faster yet, so the model keeps K-major unless LOCALPD_GEMV asks; a wrong
    value is a one-line error."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("LOCALPD_GEMV", raising=False)
    assert not gs.holds_strips(cpu) and not gs.MEASURED_FASTER
    monkeypatch.setenv("LOCALPD_GEMV", "strip")
    assert gs.holds_strips(cpu)
    monkeypatch.setenv("LOCALPD_GEMV", "kmajor")
    assert not gs.holds_strips(cpu)
    monkeypatch.setenv("LOCALPD_GEMV", "strips")
    with pytest.raises(LocalpdError, match="LOCALPD_GEMV takes strip or kmajor"):
        gs.holds_strips(cpu)


@pytest.mark.skipif(DEV != "cpu", reason="counts the Triton interpreter's launches")
def test_a_bfloat16_decode_step_in_strips_launches_this_gemv(monkeypatch):
    """The tiny model in strips (LOCALPD_GEMV=strip): each of a layer's GEMVs and the head is this kernel, its input
    rounded where it is made (the RMSNorms, the decode attention's reduce, SiLU * up), the same ten launches a layer
    as in the K-major layout, and logits within float32 rounding of the K-major integer GEMVs'."""
    from tests.kernels.test_fused_kernels import count_decode_launches

    launched, kmajor_logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True, dtype=torch.bfloat16)
    monkeypatch.setenv("LOCALPD_GEMV", "strip")
    strip_launched, logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True, dtype=torch.bfloat16)
    assert strip_launched == [n.replace("_gemv_dp4a_kernel", "_gemv_strip_kernel") for n in launched]
    assert strip_launched.count("_gemv_strip_kernel") == 9
    assert rel_err(logits, kmajor_logits) < 2e-2


def test_launch_tiles_come_from_the_measured_table_or_the_defaults():
    """One row takes the card's measured tile (none on the CPU), else programs of 16 outputs where every SM gets one
    (WIDE_TILE: 256 programs for o and down on an H100's 132 SMs, qkv's 384 on a 3090's 82) and of 4 where not;
    programs of several rows DEFAULT_TILE; every tile scripts/bench_strip.py times launches (their products are
    tested above)."""
    import sys
    from pathlib import Path

    cpu = torch.device("cpu")
    assert gs.tile_for(cpu, 4, 4096, 4096, 1) == gs.WIDE_TILE  # the interpreter's one "SM"
    assert gs.tile_for(cpu, 4, 4096, 4096, 3) == gs.DEFAULT_TILE
    assert gs.designed_tile(4096, 132) == gs.designed_tile(6144, 82) == gs.WIDE_TILE
    assert gs.designed_tile(2048, 132) == gs.designed_tile(4104, 2) == gs.DEFAULT_TILE  # 128 programs; 4104 % 16
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from bench_strip import TILES, card_entry

    assert all(set(t) == set(gs.DEFAULT_TILE) and t["PREFETCH"] in (0, 1, 2) for t in TILES)
    assert card_entry("NVIDIA H100 80GB HBM3").name == "H100 SXM" and card_entry("NVIDIA H200").name == "H200"
    s = strips("int8", 8, 1024, None, seed=2)
    x = activations(1, 1024, seed=3)
    ref = gs.gemv_strip_ref(x, s.words, s.factors, 8, s.group)
    for tile in TILES[:2]:
        assert rel_err(gs.gemv_strip(x, s.words, s.factors, 8, s.group, tile=tile), ref) < 1e-6
