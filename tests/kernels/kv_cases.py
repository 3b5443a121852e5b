"""What the KV-cache kernel tests share (test_kv_write, test_decode_attention, test_prefill_attention): Triton's
kernels against their torch references, on the CPU through Triton's interpreter, or compiled on a GPU with
LOCALPD_TEST_DEVICE=cuda.

LOCALPD_TRITON_INTERPRET makes the dispatcher launch Triton on CPU tensors (and sets TRITON_INTERPRET); it must
be set before triton is imported, so the test files import this module first."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kvcache.dispatch import paged_attention, paged_attention_ref, write_kv_ref  # noqa: E402
from localpd.kvcache.formats import dequantize_kv, new_kv_pool  # noqa: E402

DTYPES = ["fp32", "bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4", "int4ch"]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    """Autouse in every test file that imports it."""
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def pools(kv_dtype, n_pages, page_size, H, D, compute=torch.float32):
    return [new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, compute, DEV) for _ in range(2)]


def dequantized(layer):
    return [dequantize_kv(d, s, z, f, torch.float32)
            for d, s, z, f in ((layer.k, layer.k_scale, layer.k_zero, layer.k_format),
                               (layer.v, layer.v_scale, layer.v_zero, layer.v_format))]


def build_case(kv_dtype, page_size, H, group, lens, q_lens, D=64, dtype=torch.float32, seed=0, poison=False):
    """Sequences of the given lengths on shuffled pages. No sequence owns page 0, which pads the page table (and is
    where masked page-id loads point); poison fills the pool first with NaN, inf and -inf (all bits set for integer
    storage), so that reading past a sequence's end shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page_size) for n in lens) + 1
    pool = new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, dtype, DEV)
    layer = pool.layer(0)
    for t in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.k_zero, layer.v_zero) if poison else ():
        if t is not None and t.stride(1) == 0:  # a page's scales (int4ch), seen per token
            t = t[:, :1]
        if t is not None and t.is_floating_point():
            bad = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(-(-t.numel() // 3))
            t.copy_(bad[:t.numel()].view(t.shape))
        elif t is not None:
            t.view(torch.uint8).fill_(0xFF)
    order = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    tables, starts = [], [0]
    for n, t in zip(lens, q_lens):
        pages = [order.pop() for _ in range(-(-n // page_size))]
        tables.append(pages)
        k, v = torch.randn(2, n, H, D, generator=g).to(DEV)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], device=DEV)
        write_kv_ref(layer, k, v, slots)
        starts.append(starts[-1] + t)
    width = max(map(len, tables))
    table = torch.tensor([p + [0] * (width - len(p)) for p in tables], dtype=torch.int32, device=DEV)
    q = torch.randn(starts[-1], H * group, D, generator=g).to(dtype).to(DEV)
    return (q, layer, table, torch.tensor(lens, dtype=torch.int32, device=DEV),
            torch.tensor(starts, dtype=torch.int32, device=DEV))


def check(case, atol, window=0):
    if DEV != "cpu":  # the kernels' tl.dot takes float32 as tf32 on the GPU
        atol = max(atol, 5e-3)
    q, layer, table, lens, starts = case
    out = paged_attention(q, layer, table, lens, starts, q.shape[-1] ** -0.5, window)
    ref = paged_attention_ref(q, layer, table, lens, starts, q.shape[-1] ** -0.5, window)
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).abs().max().item() < atol
