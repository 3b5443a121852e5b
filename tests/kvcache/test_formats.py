"""KV page formats and the paged-attention reference, against plain dense attention."""

import pytest
import torch
import torch.nn.functional as F

from localpd.errors import LocalpdError
from localpd.kvcache.dispatch import paged_attention_ref, write_kv_ref
from localpd.kvcache.formats import (FORMATS, KV_DTYPES, PER_PAGE, check_kv_dtype, dequantize_kv, kv_bytes_per_token,
                              kv_formats, new_kv_pool, quantize_kv)

# relative error of one quantize/dequantize round trip on Gaussian data
ROUND_TRIP = {"fp32": 0, "fp16": 1e-3, "bf16": 5e-3, "int8": 1e-2, "fp8": 7e-2, "int4": 1.2e-1}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# int4ch: tests/kernels/test_kv_write.py
@pytest.mark.parametrize("kv_dtype", [f for f in FORMATS if f not in PER_PAGE])
def test_round_trip_error_and_zero_rows(kv_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 3, 64, generator=g) * 3
    x[5] = 0  # a constant row: scale 0 must not turn into NaN
    x[6, 1] = 2.5
    data, scale, zero = quantize_kv(x, kv_dtype)
    y = dequantize_kv(data, scale, zero, kv_dtype, torch.float32)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert rel(y, x) <= ROUND_TRIP[kv_dtype]
    assert (y[5] == 0).all()
    if kv_dtype != "fp8":
        assert torch.allclose(y[6, 1], x[6, 1], atol=2e-3)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bytes_per_token_is_the_storage(kv_dtype):
    pool = new_kv_pool(kv_dtype, 3, 5, 16, 2, 64, torch.float32, "cpu")
    assert pool.bytes_per_token() == kv_bytes_per_token(kv_dtype, 3, 2, 64)
    per_value = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1 + 2 / 64, "fp8": 1 + 2 / 64, "int4": 0.5 + 4 / 32,
                 "int4ch": 0.5 + 4 / 16}  # int4ch: a float16 scale and zero per channel per 16-token page
    assert pool.bytes_per_token() == sum(3 * 2 * 64 * per_value[f] for f in kv_formats(kv_dtype))
    assert pool.head_dim == 64 and pool.n_pages == 5


def test_int4_needs_a_head_dim_of_whole_groups():
    with pytest.raises(LocalpdError, match="divisible by 32"):
        new_kv_pool("int4", 1, 1, 16, 1, 80, torch.float32, "cpu")
    for bad in ("int3", "int8/int3", "int8/int4/int4", "/int4", ""):
        with pytest.raises(LocalpdError, match="unknown KV dtype"):
            check_kv_dtype(bad, "cpu")


def test_key_and_value_formats():
    assert kv_formats("int8/int4") == ("int8", "int4") and kv_formats("bf16") == ("bf16", "bf16")
    assert check_kv_dtype("int8/int8", "cpu") == "int8" and check_kv_dtype("int8/int4", "cpu") == "int8/int4"
    pool = new_kv_pool("int8/int4", 2, 3, 16, 3, 64, torch.float32, "cpu")
    assert pool.k.dtype == torch.int8 and pool.k.shape[-1] == 64 and pool.k_zero is None
    assert pool.v.dtype == torch.uint8 and pool.v.shape[-1] == 32 and pool.v_zero.shape[-1] == 2
    assert pool.head_dim == 64 and pool.layer(1).k_format == "int8" and pool.layer(1).v_format == "int4"
    # SmolLM2-135M (30 layers, 3 KV heads of 64): 66 + 40 bytes per token and head, between int4's 80 and int8's 132
    assert kv_bytes_per_token("int8/int4", 30, 3, 64) == 90 * 106


def dense_attention(q, k, v, q_len, scale):
    n = k.shape[0]
    mask = torch.ones(q_len, n, dtype=torch.bool).tril(diagonal=n - q_len)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def seen(x, fmt, layer, side, slots, page_size):
    """What attention should see of x: its quantized round trip; for a per-page format (quantized over the whole
    page as it is written), the stored codes at its slots with their page's scales."""
    if fmt not in PER_PAGE:
        return dequantize_kv(*quantize_kv(x, fmt), fmt, torch.float32)
    p, o = slots // page_size, slots % page_size
    data, scale, zero = (getattr(layer, side + suffix) for suffix in ("", "_scale", "_zero"))
    return dequantize_kv(data[p, o], scale[p, o], zero[p, o], fmt, torch.float32)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_reference_equals_dense_attention_on_scattered_pages(kv_dtype, page_size):
    """Three sequences (a decode, a chunk after a cached prefix, a whole prompt) on shuffled pages."""
    g = torch.Generator().manual_seed(2)
    H, Hq, D = 2, 6, 64
    lens, q_lens = [17, 45, 33], [1, 12, 33]
    n_pages = sum(-(-n // page_size) for n in lens) + 3
    pool = new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, torch.float32, "cpu")
    layer = pool.layer(0)
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, qs, refs, starts = [], [], [], [0]
    for n, t in zip(lens, q_lens):
        pages = [order.pop() for _ in range(-(-n // page_size))]
        tables.append(pages)
        k, v = torch.randn(2, n, H, D, generator=g)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        write_kv_ref(layer, k, v, slots)
        q = torch.randn(t, Hq, D, generator=g)
        k_seen, v_seen = (seen(x, fmt, layer, side, slots, page_size)
                          for x, fmt, side in zip((k, v), kv_formats(kv_dtype), ("k", "v")))
        refs.append(dense_attention(q, k_seen, v_seen, t, D ** -0.5))
        qs.append(q)
        starts.append(starts[-1] + t)
    width = max(map(len, tables))
    table = torch.tensor([p + [0] * (width - len(p)) for p in tables], dtype=torch.int32)
    out = paged_attention_ref(torch.cat(qs), layer, table, torch.tensor(lens, dtype=torch.int32),
                              torch.tensor(starts, dtype=torch.int32), D ** -0.5)
    assert (out - torch.cat(refs)).abs().max().item() < 1e-5
