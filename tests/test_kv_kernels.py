"""Triton KV kernels against their torch references: on the CPU through Triton's interpreter, or compiled on a
GPU with LOCALPD_TEST_DEVICE=cuda.

LOCALPD_TRITON_INTERPRET makes the dispatcher launch Triton on CPU tensors (and sets TRITON_INTERPRET); it must
be set before triton is imported."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels.kv_dispatch import paged_attention, paged_attention_ref, write_kv, write_kv_ref  # noqa: E402
from localpd.quant.kv import dequantize_kv, new_kv_pool  # noqa: E402

DTYPES = ["fp32", "bf16", "int8", "fp8", "int4"]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def pools(kv_dtype, n_pages, page_size, H, D, compute=torch.float32):
    return [new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, compute, DEV) for _ in range(2)]


def dequantized(layer):
    return [dequantize_kv(d, s, z, layer.kv_dtype, torch.float32)
            for d, s, z in ((layer.k, layer.k_scale, layer.k_zero), (layer.v, layer.v_scale, layer.v_zero))]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("D", [64, 128])
def test_write_kv_matches_the_reference(kv_dtype, D):
    g = torch.Generator().manual_seed(3)
    ps, H, T = 16, 2, 37
    tri, ref = pools(kv_dtype, 6, ps, H, D)
    slots = torch.randperm(6 * ps, generator=g)[:T].to(DEV)  # scattered, crossing pages
    k, v = (torch.randn(2, T, H, D, generator=g) * 2).to(DEV)
    k[4] = 0.0  # constant rows: no NaN
    write_kv(tri.layer(0), k, v, slots)
    write_kv_ref(ref.layer(0), k, v, slots)
    for a, b in zip(dequantized(tri.layer(0)), dequantized(ref.layer(0))):
        assert torch.isfinite(a).all()
        if kv_dtype in ("fp32", "bf16"):  # the interpreter truncates to bf16 where torch rounds: 1 ulp
            ulp = {"fp32": 0, "bf16": 2**-7}[kv_dtype]
            assert ((a - b).abs() <= b.abs() * ulp + b.abs().amax() * 2**-9).all()
            continue
        step = (b.abs().amax() / (7 if kv_dtype == "int4" else 127)).item()
        diff = (a - b).abs()
        # identical up to a rounding tie or a scale's last float16 bit (at most one quantum, rarely)
        assert diff.max().item() <= step * 1.01 + 1e-6
        assert (diff > 1e-6).float().mean().item() < 0.01


def build_case(kv_dtype, page_size, H, group, lens, q_lens, D=64, dtype=torch.float32, seed=0, poison=False):
    """Sequences of the given lengths on shuffled pages; poison fills the pool first with NaN/inf (or, for integer
    storage, extreme values) so that reading past a sequence's end shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page_size) for n in lens) + 2
    pool = new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, dtype, DEV)
    layer = pool.layer(0)
    if poison:
        for t in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.k_zero, layer.v_zero):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)  # NaN for float storage, -1 / 255 for integer storage
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, starts = [], [0]
    for n, t in zip(lens, q_lens):
        pages = [order.pop() for _ in range(-(-n // page_size))]
        tables.append(pages)
        k, v = torch.randn(2, n, H, D, generator=g).to(DEV)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], device=DEV)
        write_kv_ref(layer, k, v, slots)
        starts.append(starts[-1] + t)
    width = max(map(len, tables))
    table = torch.tensor([p + [p[0]] * (width - len(p)) for p in tables], dtype=torch.int32, device=DEV)
    q = torch.randn(starts[-1], H * group, D, generator=g).to(dtype).to(DEV)
    return (q, layer, table, torch.tensor(lens, dtype=torch.int32, device=DEV),
            torch.tensor(starts, dtype=torch.int32, device=DEV))


def check(case, atol):
    if DEV != "cpu":  # the prefill kernel's tl.dot takes float32 as tf32 on the GPU
        atol = max(atol, 5e-3)
    q, layer, table, lens, starts = case
    out = paged_attention(q, layer, table, lens, starts, q.shape[-1] ** -0.5)
    ref = paged_attention_ref(q, layer, table, lens, starts, q.shape[-1] ** -0.5)
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).abs().max().item() < atol


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("page_size, group", [(16, 1), (32, 3), (16, 4)])
def test_decode_batches_match_the_reference(kv_dtype, page_size, group):
    lens = [1, 15, 16, 17, 100]  # odd lengths, page boundaries; 100 tokens spread over split partitions
    check(build_case(kv_dtype, page_size, 2, group, lens, [1] * len(lens)), 1e-4)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_tiles_across_pages_with_garbage_past_the_end(kv_dtype, page_size):
    """Tiles span several pages: lengths ending mid-tile and mid-page, exactly one tile, under one page, very
    different lengths in one batch, GQA groups of 1, 4 and 7 (odd, padded); the pool starts as NaN garbage."""
    for group, lens in ((1, [64, 3]), (4, [130, 1, 63]), (7, [65, 200])):
        check(build_case(kv_dtype, page_size, 2, group, lens, [1] * len(lens), seed=group, poison=True), 1e-4)
    check(build_case(kv_dtype, page_size, 2, 3, [70, 33], [6, 33], seed=8, poison=True), 1e-4)  # prefill too


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_prefill_chunks_after_a_cached_prefix_and_mixed_batches(kv_dtype):
    # a chunk after a prefix, a whole prompt, a decode row and a 40-row chunk in one step
    check(build_case(kv_dtype, 16, 2, 3, [33, 17, 50, 97], [7, 17, 1, 40]), 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries(dtype):
    kv = "fp16" if dtype == torch.float16 else "bf16"
    check(build_case(kv, 16, 2, 2, [20, 45], [1, 1], dtype=dtype), 2e-2)
    check(build_case(kv, 32, 1, 4, [45, 9], [20, 9], D=128, dtype=dtype), 2e-2)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("lens", [[100], [100, 5]])
def test_decode_splits_including_empty_partitions(kv_dtype, lens):
    from localpd.kernels.kv_dispatch import decode_splits

    assert decode_splits(len(lens), 7, 16, torch.device("cpu")) > 1  # the partitions really are exercised
    check(build_case(kv_dtype, 16, 1, 4, lens, [1] * len(lens), seed=5), 1e-4)


@pytest.mark.skipif(DEV == "cpu", reason="long contexts need a GPU")
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8", "int4"])
def test_long_contexts_on_the_gpu(kv_dtype):
    """Llama-3-8B heads (8 KV heads, GQA 4, D 128) at thousands of tokens, decode and a prefill chunk."""
    check(build_case(kv_dtype, 16, 8, 4, [4099, 1, 777], [1, 1, 1], D=128, dtype=torch.bfloat16, seed=9), 2e-2)
    check(build_case(kv_dtype, 16, 8, 4, [2100, 300], [64, 300], D=128, dtype=torch.bfloat16, seed=10), 2e-2)
