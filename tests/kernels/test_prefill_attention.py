"""Prefill attention over KV pages (chunks after a cached prefix, mixed batches, odd head sizes, sliding windows)
against the torch reference, and the reference's window against attention written out."""

from kv_cases import interpret  # noqa: F401 (first: it sets TRITON_INTERPRET)
from kv_cases import DTYPES, build_case, check

import pytest
import torch

from localpd.kvcache.dispatch import decode_block_t, paged_attention_ref


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_prefill_chunks_after_a_cached_prefix_and_mixed_batches(kv_dtype):
    # a chunk after a prefix, a whole prompt, a decode row and a 40-row chunk in one step
    check(build_case(kv_dtype, 16, 2, 3, [33, 17, 50, 97], [7, 17, 1, 40]), 1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4", "int4ch/int4"])
def test_heads_of_256(kv_dtype):
    """Gemma 3's head size: decode across tiles and a prefill chunk after a prefix, its sliding window too (GQA 4
    as in the 1B, 2 as in the 4B)."""
    for group, window in ((4, 0), (2, 0), (4, 20)):
        check(build_case(kv_dtype, 16, 1, group, [70, 1, 33], [1, 1, 1], D=256, seed=group, poison=True), 1e-4,
              window)
        check(build_case(kv_dtype, 16, 2, group, [50, 40], [21, 40], D=256, seed=group + 1), 1e-4, window)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
def test_heads_that_are_not_a_power_of_two(kv_dtype):
    """Phi-3-mini's heads of 96 (no query groups) and heads of 32 and 160, taken as they are in tiles of 128, 32
    and 256 whose last columns are masked: decode across tiles over a pool of garbage (what lies past a head's
    last column, the next head's or page's elements or NaN, must not reach the output) and prefill chunks after a
    cached prefix."""
    bt = decode_block_t(16, 96)
    assert bt == decode_block_t(16, 128)  # the tile's tokens follow its width, not the head's
    for D, group in ((96, 1), (96, 3), (32, 4), (160, 2)):
        check(build_case(kv_dtype, 16, 2, group, [bt + 5, 1, 40], [1, 1, 1], D=D, seed=D, poison=True), 1e-4)
        check(build_case(kv_dtype, 16, 2, group, [50, 33], [21, 33], D=D, seed=D + 1, poison=True), 1e-4)


@pytest.mark.parametrize("dtype, kv", [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float16, "int8"),
                                       (torch.bfloat16, "int8"), (torch.float16, "fp8"), (torch.float16, "int4"),
                                       (torch.float16, "int4ch/int4")])
def test_half_precision_queries(dtype, kv):
    """Half-precision queries take dots of their own type (kvcache.dispatch.attention_dot; under the interpreter
    float16 only, whose bfloat16 dots are wrong) and, over int8 keys in decode, integer dots of each query head
    rounded to two int8 levels (int8_key_dots): within a few of the output's roundings of the reference."""
    atol = 3e-3 if dtype == torch.float16 else 2e-2
    check(build_case(kv, 16, 2, 2, [20, 45], [1, 1], dtype=dtype, seed=1), atol)
    check(build_case(kv, 32, 1, 4, [45, 9], [20, 9], D=128, dtype=dtype, seed=2), atol)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int4ch/int4"])
def test_a_sliding_window_sees_only_the_last_keys(kv_dtype):
    """Windows of 5 (inside a page), 16 (a page), 37 (across pages) and longer than any sequence, over decode rows
    (one past several tiles, so that whole splits lie before the window) and prefill chunks whose first queries'
    windows start mid-page, a 97-row chunk spanning several query blocks. The pool starts as garbage."""
    bt = decode_block_t(16, 64)
    for window in (5, 16, 37, 1000):
        check(build_case(kv_dtype, 16, 2, 3, [1, 15, 2 * bt + 7, 100], [1] * 4, seed=window, poison=True), 1e-4,
              window)
        check(build_case(kv_dtype, 16, 2, 3, [33, 70, 97], [7, 40, 97], seed=window + 1, poison=True), 1e-4, window)


def test_the_references_window_is_attention_over_the_last_keys():
    """The reference's window against softmax attention written out over keys (p - window, p] of each query p."""
    from localpd.kvcache.dispatch import gather_kv

    q, layer, table, lens, starts = build_case("fp32", 16, 2, 3, [40, 29], [1, 12], seed=3)
    window, scale = 9, 64 ** -0.5
    out = paged_attention_ref(q, layer, table, lens, starts, scale, window)
    for b, n in enumerate(lens.tolist()):
        k, v = gather_kv(layer, table[b, :-(-n // 16)].long(), n, torch.float32)
        rows = range(starts[b].item(), starts[b + 1].item())
        for r, p in zip(rows, range(n - len(rows), n)):
            keep = slice(max(0, p - window + 1), p + 1)
            for h in range(6):
                w = torch.softmax(k[keep, h // 3] @ q[r, h] * scale, dim=0)
                assert torch.allclose(out[r, h], w @ v[keep, h // 3], atol=1e-5)
