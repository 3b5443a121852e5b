"""The attention dispatcher's choices that need no kernel run (the kernels' tests are in tests/kernels)."""

import dataclasses

import pytest
import torch

from localpd.kvcache.dispatch import wide_offsets
from localpd.kvcache.formats import new_kv_pool


@pytest.mark.parametrize("kv_dtype, pages", [("bf16", 131072), ("int8", 131072), ("int4", 262144),
                                             ("int4ch/int4", 262144)])
def test_offsets_turn_64_bit_only_past_int32s_reach(kv_dtype, pages):
    """Pages of 16 tokens x 8 heads x 128: the last element of the pages' tensor lies 2**31 - 1 elements past its
    start at `pages` pages (int4 holds two codes a byte), within int32; one page more is not. A later layer's view
    (layer 1 of 2) counts from its own start. Meta tensors: nothing is allocated."""
    for n, wide in ((pages, False), (pages + 1, True)):
        assert wide_offsets(new_kv_pool(kv_dtype, 2, n, 16, 8, 128, torch.bfloat16, "meta").layer(1)) is wide
    assert not wide_offsets(new_kv_pool(kv_dtype, 1, 64, 16, 8, 128, torch.bfloat16, "meta").layer(0))


def test_a_strided_views_offsets_count_its_strides():
    """A view that is not contiguous (every other page of a pool) is measured by its strides, not its size: every
    other page of 131073 is 65537 pages, under 2**31 elements, whose last is the pool's last."""
    layer = new_kv_pool("bf16", 1, 131073, 16, 8, 128, torch.bfloat16, "meta").layer(0)
    assert wide_offsets(layer) and layer.k[::2].numel() < 2**31
    assert wide_offsets(dataclasses.replace(layer, k=layer.k[::2], v=layer.v[::2]))
    assert not wide_offsets(dataclasses.replace(layer, k=layer.k[:65536:2], v=layer.v[:65536:2]))
