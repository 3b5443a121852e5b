"""Codebook int4 (quant/codebook.py): codes into IQ4's and MXFP4's tables, in GGUF's nibble order."""

import pytest
import torch

from localpd.errors import LocalpdError
from localpd.quant import gguf_blocks
from localpd.quant.codebook import IQ4Weight, MXFP4Weight
from localpd.quant.weights import cat_rows, from_gguf, take_rows


@pytest.mark.parametrize("cls", [IQ4Weight, MXFP4Weight])
def test_values_and_scales_round_trip(cls):
    g = torch.Generator().manual_seed(1)
    values = cls.table[torch.randint(0, 16, (5, 96), generator=g)]
    scales = torch.rand(5, 3, generator=g).half()
    w = cls.from_values(values, scales)
    assert w.shape == (5, 96) and w.packed.shape == (5, 48) and w.nbytes == 5 * 48 + 5 * 3 * 2
    assert torch.equal(w.int8_values(), values)
    assert torch.equal(w.dequantize(), (values.float().reshape(5, 3, 32) * scales.float()[..., None]).reshape(5, 96))


@pytest.mark.parametrize("k", [96, 128])
def test_iq4_nl_blocks_import_exactly_in_pairs(k):
    """A pair of blocks is 32 bytes, byte j holding column j of the first in its low nibble and of the second in its
    high one; an odd last block keeps the file's 16 bytes (column j low, j + 16 high)."""
    g = torch.Generator().manual_seed(k)
    blocks = torch.randint(0, 256, (2 * k // 32, 18), dtype=torch.uint8, generator=g)
    blocks[:, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    w = from_gguf("IQ4_NL", blocks, (2, k))
    assert isinstance(w, IQ4Weight)
    assert torch.equal(w.dequantize().reshape(-1), gguf_blocks.dequantize(gguf_blocks.iq4_nl(blocks)))
    first, second = blocks[0, 2:], blocks[1, 2:]  # row 0's first two blocks, as the file holds them
    codes = [torch.cat([b & 15, b >> 4]) for b in (first, second)]
    assert torch.equal(w.packed[0, :32], codes[0] | (codes[1] << 4))
    if k == 96:
        assert torch.equal(w.packed[0, 32:], blocks[2, 2:])


def test_rows_taken_and_stacked():
    g = torch.Generator().manual_seed(3)
    a, b = (IQ4Weight.from_values(IQ4Weight.table[torch.randint(0, 16, (n, 64), generator=g)],
                                  torch.rand(n, 2, generator=g).half()) for n in (3, 4))
    both = cat_rows([a, b])
    assert isinstance(both, IQ4Weight) and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert torch.equal(take_rows(both, torch.tensor([4, 0]), torch.float32), both.dequantize()[[4, 0]])


def test_a_value_outside_the_codebook_is_an_error():
    with pytest.raises(LocalpdError, match="codebook"):
        IQ4Weight.from_values(torch.full((1, 32), 7, dtype=torch.int8), torch.ones(1, 1, dtype=torch.float16))
    with pytest.raises(LocalpdError, match="multiple of 32"):
        IQ4Weight(torch.zeros(1, 8, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.float16))
