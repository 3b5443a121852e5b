"""The K-major layout (quant/kmajor.py) and its batch-1 GEMV (kernels/gemv_kmajor.py) against the torch
references, in Triton's interpreter on the CPU (LOCALPD_TEST_DEVICE=cuda runs them on a GPU)."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels import gemv_kmajor as km  # noqa: E402
from localpd.kernels.dispatch import PreNorm, kmajor_matmul_ref, linear_kmajor  # noqa: E402
from localpd.quant.kmajor import KMajorInt4, KMajorInt8, to_kmajor  # noqa: E402
from localpd.quant.weights import Int4Weight, Int8Weight, take_rows  # noqa: E402

# bf16 outputs round to 8 bits; the interpreter truncates where the GPU rounds, and the fused input steps round
# the activation once more (as their separate kernels do)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def triton_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def weight(fmt: str, n: int, k: int, group: int | None, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    q = Int4Weight.quantize_rtn(w, group) if fmt == "int4" else Int8Weight.quantize(w, group)
    return q, to_kmajor(q)


def moved(kw):
    return type(kw)(kw.words.to(DEV), kw.factors.to(DEV))


def rand(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", None), ("int8", 64)])
def test_the_layout_is_the_row_major_weight_transposed(fmt, group):
    """Same matrix, bit for bit, both ways; an embedding lookup from the K-major form dequantizes those rows."""
    q, kw = weight(fmt, 72, 256, group, seed=1)
    assert isinstance(kw, KMajorInt4 if fmt == "int4" else KMajorInt8)
    assert kw.shape == q.shape and kw.group == q.group
    assert kw.words.shape == (256 * kw.BITS // 32, 72)
    assert torch.equal(kw.dequantize(), q.dequantize())
    back = kw.to_weight()
    assert type(back) is type(q) and torch.equal(back.dequantize(), q.dequantize())
    rows = torch.tensor([5, 0, 71, 5])
    assert torch.equal(take_rows(kw, rows, torch.float32), q.dequantize()[rows])
    assert kw.nbytes == 4 * (kw.words.numel() + kw.factors.numel())


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", None), ("int8", 64)])
@pytest.mark.parametrize("n,k,m,dtype,split", [(200, 256, 1, torch.bfloat16, None), (130, 576, 1, torch.float32, 1),
                                               (72, 384, 3, torch.float32, 3), (130, 576, 1, torch.bfloat16, 5)])
def test_gemv_matches_the_reference(fmt, group, n, k, m, dtype, split):
    """Partial column tiles (N not a multiple of 128), K not a multiple of 128 (576: SmolLM2's), groups smaller
    than and equal to a tile, per-channel int8, several rows, split-K reduced inside the launch, a bias."""
    if group and k % group:
        group = 32
    _, kw = weight(fmt, n, k, group, seed=n + k)
    kw = moved(kw)
    x, bias = rand(m, k, dtype=dtype, seed=k), rand(n, dtype=dtype, seed=n)
    y = km.gemv_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, bias=bias, split_k=split)
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, kmajor_matmul_ref(x, kw, bias)) < TOL[dtype]
    assert rel_err(y, kmajor_matmul_ref(x, kw)) > 10 * TOL[dtype]  # the bias counts
    _, cnt = km.workspace(x.device, 0, 0)
    assert not cnt.any()  # the last program of each tile left its counter at zero for the next launch


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int8", None)])
@pytest.mark.parametrize("m,split,residual", [(1, 1, True), (1, 4, True), (2, 3, False), (1, None, True)])
def test_normed_gemv_is_add_rms_norm_then_the_product(fmt, group, m, split, residual):
    """The RMSNorm prologue: each split sums only its own slice's squares and the last one applies the factor;
    the residual stream x + r comes back as add_rms_norm writes it."""
    from localpd.kernels.fused_dispatch import add_rms_norm_ref

    n, k = 200, 384
    _, kw = weight(fmt, n, k, group, seed=3)
    kw = moved(kw)
    x = rand(m, k, dtype=torch.float32, seed=4, scale=3.0)
    r = rand(m, k, dtype=torch.float32, seed=5) if residual else None
    g = (1 + torch.rand(k, generator=torch.Generator().manual_seed(6))).to(DEV)
    y, s = km.gemv_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, norm=PreNorm(r, g, 1e-5), split_k=split)
    h, s_ref = add_rms_norm_ref(x, r, g, 1e-5)
    assert torch.equal(s, s_ref) if residual else s is x
    assert rel_err(y, kmajor_matmul_ref(h, kw)) < TOL[torch.float32]
    y2, _ = km.gemv_kmajor(2 * x, kw.words, kw.factors, kw.BITS, kw.group, norm=PreNorm(None, g, 1e-5),
                           split_k=split)  # scale-free: twice the row, the same normalised product
    y1, _ = km.gemv_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, norm=PreNorm(None, g, 1e-5), split_k=split)
    assert rel_err(y2, y1) < 1e-5


@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int8", 64)])
@pytest.mark.parametrize("act,split", [("silu", 1), ("gelu_tanh", 3)])
def test_gated_gemv_is_the_down_projection_of_act_mul(fmt, group, act, split):
    from localpd.kernels.fused_dispatch import act_mul_ref

    n, k = 72, 384
    _, kw = weight(fmt, n, k, group, seed=7)
    kw = moved(kw)
    gate_up = rand(1, 2 * k, dtype=torch.float32, seed=8, scale=2.0)
    y = km.gemv_kmajor(gate_up, kw.words, kw.factors, kw.BITS, kw.group, gated=act, split_k=split)
    assert rel_err(y, kmajor_matmul_ref(act_mul_ref(gate_up, act), kw)) < TOL[torch.float32]
    other = "silu" if act == "gelu_tanh" else "gelu_tanh"
    assert rel_err(y, kmajor_matmul_ref(act_mul_ref(gate_up, other), kw)) > 1e-3


@pytest.mark.parametrize("fmt,group", [("int4", 64), ("int8", None)])
def test_linear_takes_any_rows_and_the_fused_inputs(fmt, group):
    """linear_kmajor: the GEMV up to MAX_ROWS rows, dequantize + matmul beyond (here with the dequantization in
    several chunks of inputs), the norm and gate computed apart there; leading dimensions kept."""
    n, k = 96, 256
    _, kw = weight(fmt, n, k, group, seed=9)
    kw = moved(kw)
    for rows in (1, km.MAX_ROWS, km.MAX_ROWS + 3):
        x = rand(rows, 1, k, dtype=torch.float32, seed=rows)
        assert rel_err(linear_kmajor(x, kw), kmajor_matmul_ref(x.reshape(rows, k), kw).reshape(rows, 1, n)) < 1e-5
        gate_up = rand(rows, 2 * k, dtype=torch.float32, seed=rows + 1)
        assert rel_err(linear_kmajor(gate_up, kw, gated="silu"), kmajor_matmul_ref(gate_up, kw, gated="silu")) < 1e-5
        r, g = rand(rows, k, dtype=torch.float32, seed=2), rand(k, dtype=torch.float32, seed=3)
        y, s = linear_kmajor(x.reshape(rows, k), kw, norm=PreNorm(r, g, 1e-6))
        y_ref, s_ref = kmajor_matmul_ref(x.reshape(rows, k), kw, norm=PreNorm(r, g, 1e-6))
        assert rel_err(y, y_ref) < 1e-5 and torch.equal(s, s_ref)


def test_dequantized_product_in_chunks(monkeypatch):
    """The GEMM path dequantizes W.T a chunk of inputs at a time when the matrix is large; the chunks add up."""
    monkeypatch.setattr(km, "DEQUANT_ROWS", 128 * 40)  # 128 inputs of 40 outputs a chunk
    _, kw = weight("int4", 40, 640, 128, seed=10)
    kw = moved(kw)
    x, bias = rand(12, 640, dtype=torch.float32, seed=11), rand(40, dtype=torch.float32, seed=12)
    y = km.dequant_matmul_kmajor(x, kw.words, kw.factors, 4, 128, bias)
    assert rel_err(y, kmajor_matmul_ref(x, kw, bias)) < 1e-5


def test_split_sizes_give_every_sm_several_programs():
    """split_for: Llama-3-8B's decode shapes at one row launch at least 4 programs per SM of an H100 (132), and
    no launch has more slices than K has tiles."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (3584, 18944)):
        bk = km.block_k(k, 4, 128)
        split = km.split_for(1, n, k, bk, 132)
        assert -(-n // km.BLOCK_N) * split >= 4 * 132 and split <= k // bk
    assert km.block_k(576, 4, 32) == 64 and km.block_k(160, 8, 160) == 32
    with pytest.raises(ValueError):
        km.block_k(100, 4, 100)


@pytest.mark.parametrize("tile", [dict(PREFETCH=True), dict(BLOCK_K=64, num_warps=2, PREFETCH=True, per_sm=8),
                                  dict(BLOCK_K=256, num_warps=8, per_sm=1)])
def test_every_launch_tile_computes_the_same_product(tile):
    """The launch knobs scripts/sweep_kmajor.py times (the next trip's words loaded ahead, other BLOCK_K, warps
    and programs per SM) change the speed, not the product; a BLOCK_K that does not fit K falls back to block_k."""
    for fmt, group, n, k in (("int4", 128, 200, 512), ("int8", None, 72, 384), ("int4", 32, 130, 576)):
        _, kw = weight(fmt, n, k, group, seed=k)
        kw = moved(kw)
        x = rand(1, k, dtype=torch.float32, seed=n)
        r, g = rand(1, k, dtype=torch.float32, seed=1), rand(k, dtype=torch.float32, seed=2)
        y, s = km.gemv_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, norm=PreNorm(r, g, 1e-5), tile=tile)
        y_ref, s_ref = kmajor_matmul_ref(x, kw, norm=PreNorm(r, g, 1e-5))
        assert rel_err(y, y_ref) < 1e-5 and torch.equal(s, s_ref)


@pytest.mark.parametrize("fmt,group", [("int4", 64), ("int8", None)])
@pytest.mark.parametrize("m,split", [(2, 1), (4, 3), (5, 2), (7, 1)])
def test_rows_sharing_a_program_are_each_rows_own_product(fmt, group, m, split):
    """Up to 4 rows share a program's words (2 and 4 exactly, 5 and 7 in a full block and a padded one): each row's
    output is bit for bit what the row alone gives with the same split."""
    n, k = 136, 384
    _, kw = weight(fmt, n, k, group, seed=m)
    kw = moved(kw)
    x, bias = rand(m, k, dtype=torch.float32, seed=m + 1), rand(n, dtype=torch.float32, seed=3)
    y = km.gemv_kmajor(x, kw.words, kw.factors, kw.BITS, kw.group, bias=bias, split_k=split)
    assert rel_err(y, kmajor_matmul_ref(x, kw, bias)) < 1e-5
    for r in range(m):
        alone = km.gemv_kmajor(x[r:r + 1], kw.words, kw.factors, kw.BITS, kw.group, bias=bias, split_k=split)
        assert torch.equal(y[r:r + 1], alone), r
