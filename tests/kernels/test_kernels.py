"""Triton int4/int8 matmul kernels against their torch references: on the CPU through Triton's interpreter, or
compiled on a GPU with LOCALPD_TEST_DEVICE=cuda (the same checks, the same references).

TRITON_INTERPRET must be set before the kernel modules are imported (Triton reads it when a kernel is
decorated), so it is set here, before anything imports triton.
"""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.errors import LocalpdError  # noqa: E402
from localpd.kernels.dispatch import (gemv_block_m, int4_matmul_ref, int8_matmul_ref, linear_int4,  # noqa: E402
                                      linear_int8, pick_split_k)
from localpd.kernels.quant_matmul import int4_matmul, int8_matmul  # noqa: E402
from localpd.quant.weights import Int4Weight, Int8Weight  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NS = (40, 72, 200)
KS = (128, 256, 384)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(fmt, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if fmt == "int4":
        q = Int4Weight.quantize(w, group)
        args = (q.packed.to(DEV), q.scales.to(DEV), q.biases.to(DEV), group)
        return args, int4_matmul, int4_matmul_ref
    q = Int8Weight.quantize(w, group)
    args = (q.data.to(DEV), q.scales.to(DEV), q.group)
    return args, int8_matmul, int8_matmul_ref


def check(fmt, m, n, k, group, dtype, seed, **kw):
    args, kernel, ref_fn = make_case(fmt, n, k, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)  # poison: every element must be written
    y = kernel(x, *args, out=out, **kw)
    ref = ref_fn(x, *args)
    assert y is out and y.dtype == dtype and y.shape == (m, n)
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < TOL[dtype], (fmt, m, n, k, group, dtype, kw)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 3, 6, 16, 33])
def test_matches_reference(fmt, m):
    """Every K with every group size dividing it; N cycles through odd sizes; dtypes rotate."""
    groups = (32, 64, 128) if fmt == "int4" else (32, 128, None)
    i = 0
    for k in KS:
        for group in groups:
            check(fmt, m, NS[i % 3], k, group or k, DTYPES[i % len(DTYPES)], seed=100 * m + i)
            i += 1


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_gemv(fmt, dtype):
    check(fmt, 2, 72, 256, 64, dtype, seed=7)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m,split_k", [(1, 2), (3, 3), (12, 4), (1, 5)])
def test_split_k(fmt, m, split_k):
    # K = 384 is 3 chunks of the interpreter's BLOCK_K = 128 (more on the GPU): uneven splits, empty ones for 4, 5
    check(fmt, m, 200, 384, 32, torch.float32, seed=split_k, split_k=split_k)
    check(fmt, m, 40, 384, 128, torch.float16, seed=split_k + 10, split_k=split_k)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_k_tail_and_forced_paths(fmt):
    # K = 160 leaves a partial K chunk for both paths; the GEMM path also for small M
    check(fmt, 1, 40, 160, 32, torch.float32, seed=1)
    check(fmt, 3, 40, 160, 32, torch.float32, seed=2, split_k=2)
    check(fmt, 3, 72, 160, 32, torch.float32, seed=3, path="gemm")
    check(fmt, 16, 40, 256, 64, torch.float16, seed=4, path="gemm")
    check(fmt, 40, 200, 160, 32, torch.float16, seed=5)


@pytest.mark.parametrize("fmt,m,n,k,dtype,block_n,block_k,split_k", [
    ("int4", 1, 40, 384, torch.float32, 16, 256, 1), ("int4", 3, 72, 512, torch.bfloat16, 32, 128, 1),
    ("int4", 16, 72, 512, torch.float16, 32, 256, 2), ("int4", 7, 33, 640, torch.bfloat16, 64, 512, 1),
    ("int4", 9, 33, 640, torch.bfloat16, 16, 128, 3), ("int8", 5, 40, 384, torch.bfloat16, 32, 256, 1),
    ("int8", 2, 40, 512, torch.float16, 16, 128, 3), ("int8", 1, 200, 160, torch.float32, 64, 256, 1)])
def test_tensor_core_gemv_matches_reference(fmt, m, n, k, dtype, block_n, block_k, split_k):
    """The experimental tensor-core GEMV (kernels/gemv_mma.py; int4 in groups of 128, int8 per channel): rows
    padded to 16, partial N tiles, K tails, tiles of one group and of several, split-K, the layer's bias."""
    from localpd.kernels.gemv_mma import gemv_mma

    args, _, ref_fn = make_case(fmt, n, k, 128 if fmt == "int4" else k, seed=m + n + k)
    gen = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEV) if m % 2 else None
    if fmt == "int4":
        packed, scales, biases, group = args
        y = gemv_mma(x, packed, scales, biases, 4, group, bias=bias, block_n=block_n, block_k=block_k,
                     split_k=split_k)
    else:
        data, scales, group = args
        y = gemv_mma(x, data.view(torch.int32), scales, None, 8, group, bias=bias, block_n=block_n,
                     block_k=block_k, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == dtype and not torch.isnan(y).any()
    assert rel_err(y, ref_fn(x, *args, bias=bias)) < TOL[dtype], (fmt, m, n, k, dtype)


def test_tensor_core_gemv_costs_the_same_per_word_at_any_m(sass_table):
    """The tensor-core GEMV compiled for sm_86 (scripts/gemv_sass.py --mma): the products go to the tensor cores,
    so its loop does the same work per weight word for 1 or 16 rows, under an RTX 3090's budget of 76 (int4-g128)
    and an H100's 45 (int8), where the CUDA-core GEMV at M = 8 takes 152-259 per int4 word."""
    rows = sass_table("gemv_sass.py", "--mma", "--arch", "86", "--configs", "64,256,4;128,256,8")
    assert len(rows) == 4, rows
    assert all(float(r[5]) < (76 if r[1] == "int4-g128" else 45) and r[-1] == "0" for r in rows), rows


def test_tensor_core_gemv_refuses_what_it_cannot_take():
    """A dot's K is one group's words of one field: int4 in groups under 128 and int8 in groups have too few;
    more than 16 rows need the GEMM path."""
    from localpd.kernels.gemv_mma import gemv_mma, mma_fits

    assert mma_fits(4, 128, 4096, 256) and mma_fits(8, 4096, 4096, 128) and mma_fits(8, 576, 576, 1024)
    assert not mma_fits(4, 64, 4096, 256) and not mma_fits(8, 32, 4096, 256) and not mma_fits(4, 128, 4096, 64)
    (packed, scales, biases, group), _, _ = make_case("int4", 40, 384, 32, seed=1)
    with pytest.raises(LocalpdError, match="groups of 32"):
        gemv_mma(torch.randn(1, 384).to(DEV), packed, scales, biases, 4, group)
    (packed, scales, biases, group), _, _ = make_case("int4", 40, 384, 128, seed=1)
    with pytest.raises(LocalpdError, match="1..16"):
        gemv_mma(torch.randn(17, 384).to(DEV), packed, scales, biases, 4, group)


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", None), ("int8", 64)])
@pytest.mark.parametrize("m,dtype,split_k,path,act", [
    (1, torch.bfloat16, None, None, "silu"), (1, torch.bfloat16, None, None, "gelu_tanh"),
    (3, torch.float16, 2, None, "silu"), (1, torch.float32, 3, None, "gelu_tanh"),
    (12, torch.bfloat16, None, "gemv", "gelu_tanh"), (20, torch.float16, None, None, "silu")])
def test_gated_matmul_is_the_down_projection_of_act_mul(monkeypatch, fmt, group, m, dtype, split_k, path, act):
    """gated=act takes [gate | up] (2K wide) and multiplies act(gate) * up (SiLU, or Gemma's tanh GELU): against
    the reference, and, on the GEMV path, bit for bit what the kernel gives for the output of the separate act_mul
    kernel."""
    from localpd.kernels.fused_dispatch import act_mul

    n, k = 72, 384
    args, kernel, ref_fn = make_case(fmt, n, k, group or k, seed=m + k)
    gate_up = (torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m)) * 2).to(dtype).to(DEV)
    y = kernel(gate_up, *args, split_k=split_k, path=path, gated=act)
    assert y.shape == (m, n) and y.dtype == dtype
    # Triton's interpreter rounds fp32 to bf16 by truncation (the GPU rounds to nearest): here the activation is
    # rounded twice more than in a plain matmul, so bf16 gets twice the tolerance on the CPU
    tol = TOL[dtype] * (2 if DEV == "cpu" and dtype == torch.bfloat16 else 1)
    assert rel_err(y, ref_fn(gate_up, *args, gated=act)) < tol
    other = "silu" if act == "gelu_tanh" else "gelu_tanh"
    assert rel_err(y, ref_fn(gate_up, *args, gated=other)) > 3 * tol  # the activation is the one asked for
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")  # the act_mul kernel, not its torch reference
    separate = kernel(act_mul(gate_up, act), *args, split_k=split_k, path=path)
    if DEV == "cpu" and (path == "gemv" or m <= 8):  # compiled, the two may contract multiply-adds differently
        assert torch.equal(y, separate)
    assert rel_err(y, separate) < tol
    with pytest.raises(LocalpdError, match=f"expected activations of shape \\[M, {2 * k}\\]"):
        kernel(gate_up[:, :k], *args, gated=act)
    with pytest.raises(LocalpdError, match="unknown MLP activation 'relu'"):
        kernel(gate_up, *args, gated="relu")


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", None), ("int8", 64)])
@pytest.mark.parametrize("m,dtype,split_k,path,residual", [
    (1, torch.bfloat16, None, None, True), (1, torch.float32, None, None, False), (3, torch.float16, 2, None, True),
    (1, torch.float32, 3, None, True), (5, torch.bfloat16, 4, None, False), (12, torch.bfloat16, None, "gemv", True),
    (20, torch.float16, None, None, True)])
def test_normed_matmul_is_add_rms_norm_then_matmul(monkeypatch, fmt, group, m, dtype, split_k, path, residual):
    """norm=PreNorm(residual, weight, eps) multiplies RMSNorm(x + residual) * weight and returns x + residual too:
    against the reference and against the separate add_rms_norm kernel followed by the plain matmul, split-K
    (whose splits each sum the whole row's squares first) and the GEMM path included."""
    from localpd.kernels.dispatch import PreNorm
    from localpd.kernels.fused_dispatch import add_rms_norm

    n, k = 72, 384
    args, kernel, ref_fn = make_case(fmt, n, k, group or k, seed=m + k)
    g = torch.Generator().manual_seed(m + 1)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(DEV)
    res = torch.randn(m, k, generator=g).to(dtype).to(DEV) if residual else None
    weight = (1 + torch.rand(k, generator=g)).to(dtype).to(DEV)
    norm = PreNorm(res, weight, 1e-5)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    y, s = kernel(x, *args, out=out, split_k=split_k, path=path, norm=norm)
    y_ref, s_ref = ref_fn(x, *args, norm=norm)
    assert y is out and y.shape == (m, n) and y.dtype == dtype and not torch.isnan(y).any()
    assert residual or s is x
    if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates the bf16 sum where torch rounds it
        assert torch.allclose(s, s_ref, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(s, s_ref)  # the residual stream, rounded as add_rms_norm rounds it
    tol = TOL[dtype] * (2 if DEV == "cpu" and dtype == torch.bfloat16 else 1)  # see the gated test
    assert rel_err(y, y_ref) < tol
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")  # the add_rms_norm kernel, not its torch reference
    h, s_sep = add_rms_norm(x, res, weight, 1e-5)
    assert torch.equal(s, s_sep)
    assert rel_err(y, kernel(h, *args, split_k=split_k, path=path)) < tol
    # the scaling matters: a row twice as large gives the same normalised product
    if not residual:
        y2, _ = kernel(x * 2, *args, split_k=split_k, path=path, norm=norm)
        assert rel_err(y2, y) < tol
    with pytest.raises(LocalpdError, match="residual"):
        kernel(x, *args, norm=PreNorm(torch.zeros(m, k + 1, dtype=dtype, device=DEV), weight, 1e-5))
    with pytest.raises(LocalpdError, match="either a gated or a normalised"):
        kernel(torch.cat([x, x], 1), *args, gated="silu", norm=norm)


@pytest.mark.parametrize("fmt,group", [("int4", 64), ("int8", None)])
@pytest.mark.parametrize("m,dtype,split_k,path,normed", [
    (1, torch.bfloat16, None, None, False), (2, torch.float32, 3, None, False), (1, torch.float16, 4, None, True),
    (3, torch.float32, None, "gemv", True), (11, torch.float32, None, None, True)])
def test_layer_bias_is_added_by_the_matmul(fmt, group, m, dtype, split_k, path, normed):
    """bias= (a layer's bias, Qwen2's q/k/v) is added in the GEMV's epilogue, once under split-K, and after the
    GEMM: against the reference, which adds it to the rounded product."""
    from localpd.kernels.dispatch import PreNorm

    n, k = 72, 384
    args, kernel, ref_fn = make_case(fmt, n, k, group or k, seed=m)
    g = torch.Generator().manual_seed(m + 2)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    bias = (torch.randn(n, generator=g) * 4).to(dtype).to(DEV)  # large beside the product: a missed add shows
    norm = PreNorm(torch.randn(m, k, generator=g).to(dtype).to(DEV), (1 + torch.rand(k, generator=g)).to(dtype).to(DEV),
                   1e-6) if normed else None
    y = kernel(x, *args, bias=bias, split_k=split_k, path=path, norm=norm)
    ref = ref_fn(x, *args, bias=bias, norm=norm)
    if normed:
        (y, s), (ref, s_ref) = y, ref
        assert torch.equal(s, s_ref)
    tol = TOL[dtype] * (2 if DEV == "cpu" and dtype == torch.bfloat16 else 1)
    assert rel_err(y, ref) < tol
    with pytest.raises(LocalpdError, match="bias must have 72"):
        kernel(x, *args, bias=bias[:-1])


def test_gemv_path_refuses_large_m():
    args, kernel, _ = make_case("int4", 40, 128, 32, 0)
    with pytest.raises(LocalpdError, match="gemv"):
        kernel(torch.randn(17, 128, device=DEV), *args, path="gemv")


@pytest.mark.skipif(DEV != "cpu", reason="CPU dispatch")
@pytest.mark.parametrize("path", ["interpreter", "cpu-kernels", "reference"])
def test_linear_dispatch(monkeypatch, path):
    import localpd.kernels.cpu as cpu
    import localpd.kernels.dispatch as dispatch

    def forbidden(*args, **kwargs):
        raise AssertionError("the other path ran")

    if path == "interpreter":  # LOCALPD_TRITON_INTERPRET=1: the Triton kernels run on CPU tensors, not the references
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")
        monkeypatch.setattr(dispatch, "int4_matmul_ref", forbidden)
        monkeypatch.setattr(dispatch, "int8_matmul_ref", forbidden)
        monkeypatch.setattr(cpu, "linear", forbidden)
    else:  # plain CPU, even with TRITON_INTERPRET set: localpd's CPU kernels, or the torch references without them
        monkeypatch.delenv("LOCALPD_TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(dispatch, "_triton_fn", forbidden)
        if path == "cpu-kernels":
            monkeypatch.setattr(dispatch, "int4_matmul_ref", forbidden)
            monkeypatch.setattr(dispatch, "int8_matmul_ref", forbidden)
        else:
            monkeypatch.setattr(cpu, "library", lambda: None)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 128, generator=g)
    bias = torch.randn(72, generator=g)
    w4 = Int4Weight.quantize(torch.randn(72, 128, generator=g), 64)
    w8 = Int8Weight.quantize(torch.randn(72, 128, generator=g))
    y4, y8 = linear_int4(x, w4, bias), linear_int8(x, w8, bias)
    assert y4.shape == y8.shape == (2, 3, 72)
    ref4 = x @ w4.dequantize().T + bias
    ref8 = x @ w8.dequantize().T + bias
    # the CPU kernels round each block of 32 inputs to two int8 levels (kernels/cpu_kernels.c): their own error
    tol = 1e-4 if path == "cpu-kernels" else 1e-5
    assert rel_err(y4, ref4) < tol and rel_err(y8, ref8) < tol
    with pytest.raises(LocalpdError, match="features"):
        linear_int4(torch.randn(1, 64), w4)


@pytest.mark.skipif(DEV != "cpu", reason="a table for the interpreter")
def test_measured_gemv_configurations_replace_the_heuristics(monkeypatch):
    """A shape in the table of measured configurations (scripts/sweep_gemv.py --table) launches with its tile
    sizes and split-K, never asking the split-K heuristic; other shapes go on as before."""
    import localpd.kernels.dispatch as dispatch
    import localpd.kernels.quant_matmul as qm

    cfg = dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=1, split_k=3, us=1.0, measured="test")
    table = {"interpreter": {"4:32:40:384:1": cfg, "8:384:72:384:2": {**cfg, "BLOCK_N": 64, "split_k": 1}}}
    monkeypatch.setattr(dispatch, "gemv_table", lambda: table)
    assert dispatch.tuned_gemv(torch.device("cpu"), 4, 32, 40, 384, 1) == dict(BLOCK_N=16, BLOCK_K=64, num_warps=2,
                                                                               num_stages=1, split_k=3)
    assert dispatch.tuned_gemv(torch.device("cpu"), 4, 32, 40, 384, 2) is None
    launches = []
    real = qm._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((args[13], meta["BLOCK_N"], meta["BLOCK_K"]))  # split_k (argument 13), tile
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(qm, "_gemv_kernel", Spy())
    monkeypatch.setattr(qm, "_GEMV", Spy())
    monkeypatch.setattr(qm, "pick_split_k", lambda *a: pytest.fail("the heuristic ran for a measured shape"))
    check("int4", 1, 40, 384, 32, torch.float32, 5)
    check("int8", 2, 72, 384, 384, torch.bfloat16, 6)
    assert launches == [(3, 16, 64), (1, 64, 64)]
    monkeypatch.setattr(qm, "pick_split_k", lambda *a: 2)
    check("int4", 1, 40, 384, 64, torch.float32, 7)  # not in the table: heuristic split, interpreter tile
    assert launches[-1] == (2, 32, 128)


def test_shipped_gemv_table_is_well_formed():
    from localpd.kernels.dispatch import GEMV_TABLE, TUNED_FIELDS, gemv_table

    for device, shapes in gemv_table().items():
        for shape, cfg in shapes.items():
            bits, group, n, k, block_m = map(int, shape.split(":"))
            assert bits in (4, 8) and k % group == 0 and block_m in (1, 2, 4, 8, 16), (GEMV_TABLE, device, shape)
            assert all(isinstance(cfg[f], int) and cfg[f] > 0 for f in TUNED_FIELDS) and cfg["measured"]


def test_gemv_autotuner_keeps_its_timings_on_disk(monkeypatch):
    """Outside the interpreter the GEMV is autotuned, and the timings go to Triton's disk cache, so a second
    process (the next `localpd chat`, a server reaching a new batch size) launches without timing candidates."""
    import triton

    import localpd.kernels.quant_matmul as qm

    monkeypatch.setattr(qm, "triton_interpreting", lambda: False)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)  # the Autotuner never caches under it
    tuner = qm._gemv_launcher()
    assert isinstance(tuner, triton.runtime.Autotuner) and tuner.cache_results
    assert len(tuner.configs) == len(qm.GEMV_CONFIGS)


def test_launch_heuristics():
    assert [gemv_block_m(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert pick_split_k(576, 1536, 132) > 1            # 36 tiles of 16 on 132 SMs: split
    assert pick_split_k(4096, 4096, 132) == 1          # 256 tiles: enough already
    assert pick_split_k(576, 256, 132) == 1            # too little K to split
    assert pick_split_k(4096, 4096, 1) == 1            # interpreter / CPU


@pytest.mark.skipif(DEV == "cpu", reason="real model sizes need a GPU")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 17, 512])
def test_model_sized_shapes(fmt, m):
    """Llama-3-8B and SmolLM2 shapes (autotuned configs, split-K chosen by the SM count) and an odd N."""
    for i, (n, k) in enumerate([(6144, 4096), (4096, 14336), (1536, 576), (49152 + 7, 576)]):
        check(fmt, m, n, k, 32 if k % 128 else 128, (torch.bfloat16, torch.float16)[i % 2], seed=m * 10 + i)


def test_word_align_is_what_the_words_allow():
    from localpd.kernels.quant_matmul import word_align

    words = torch.zeros(6, 40, dtype=torch.int32)
    assert [word_align(words[:, :w]) for w in (40, 36, 6, 5)] == [4, 4, 2, 1]  # row stride 40 in every view
    assert word_align(torch.zeros(3, 10, dtype=torch.int32)[:, :8]) == 2  # 8 words a row, rows 10 apart


def test_one_warp_gemv_tiles_fit_a_3090s_budget_with_the_prologues(sass_table):
    """The one-warp autotune candidates, compiled for sm_86 at M = 1 (scripts/gemv_sass.py): with the RMSNorm and
    SiLU prologues their int4 loops stay under an RTX 3090's 76 instructions per weight word, without spilling
    (the 4-warp candidates took 167-272); at M = 4 the 16-column tile no longer fits a thread and is pruned."""
    from localpd.kernels.dispatch import GEMV_CONFIGS, gemv_tile_fits

    one_warp = [c for c in GEMV_CONFIGS if c[2] == 1]
    assert one_warp and all(gemv_tile_fits(1, bn, bk, bits, 1) for bn, bk, _, _ in one_warp for bits in (4, 8))
    assert not gemv_tile_fits(4, 16, 256, 8, 1) and not gemv_tile_fits(4, 16, 256, 4, 1)
    assert gemv_tile_fits(2, 16, 256, 4, 1) and not gemv_tile_fits(2, 16, 512, 4, 1)
    configs = ";".join(",".join(map(str, c)) for c in one_warp)
    rows = sass_table("gemv_sass.py", "--arch", "86", "--formats", "int4-g128", "--variants", "norm,gated",
                      "--configs", configs)
    assert len(rows) == 2 * len(one_warp), rows
    assert all(float(r[5]) < 76 and r[10] == "0" for r in rows), rows


def test_gemv_candidates_for_eight_rows_keep_their_registers(sass_table):
    """The int4 candidates the autotuner keeps for M = 5..8 (a server's decode batch), plain and with each prologue,
    compiled for sm_86 and sm_90 (scripts/gemv_sass.py): no loop reloads spilled registers from local memory.
    Counted in words (64 a thread) the rule kept tiles of 512 products a thread, (8, 1024, 4) and (8, 512, 2)
    among them, whose loops made up to 159 local-memory accesses a trip (Triton 3.9)."""
    rows = sass_table("gemv_sass.py", "--arch", "86,90", "--formats", "int4-g128", "--m", "8")
    assert len(rows) == 2 * 3 * 2, rows  # two archs, three variants, the two tiles that fit 8 rows
    assert all(r[-1] == "0" and int(r[9]) < 255 for r in rows), rows


def test_decode_gemv_compiles_to_16_byte_loads_without_shared_memory(sass_table):
    """The M = 1 int4 GEMV's sm_90 code, built on this CPU by Triton's compiler and ptxas (scripts/gemv_sass.py):
    the weight tile is loaded in the layout its products are computed in, so the main loop has no barrier and no
    shared-memory instruction, and reads 16 bytes of words per load. Before, it loaded [BLOCK_N, G, WPG] words 8
    bytes at a time and moved every field through shared memory (20-36 barriers per trip)."""
    (row,) = sass_table("gemv_sass.py", "--formats", "int4-g128", "--variants", "plain", "--configs", "32,256,4,3")
    per_word, barriers, shared, load, _, spilled, _ = row[5:]
    assert (barriers, shared, load, spilled) == ("0", "0", "LDG.E.128", "0"), row
    assert float(per_word) < 100, row  # 8 fields a word at about 3 instructions each, plus the activations
