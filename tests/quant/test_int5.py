"""5-bit weights (quant/int5.py): Q5_0, Q5_1 and Q5_K blocks import bit for bit as gguf's own dequantization
reads them, at the file's bytes (Q5_K: half a byte more a group, int4-k's eight-bit scales); the fifth bits lie
where the CPU kernels expand them; the GPU's int8 form is near; malformed tensors are one-line errors; a
quantized directory keeps the format."""

from dataclasses import fields

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize

from localpd.errors import LocalpdError
from localpd.quant.int5 import Int5KWeight, Int5Weight, bit_plane, join_codes, split_codes
from localpd.quant.store import TENSORS, load_quantized, save_quantized
from localpd.quant.weights import from_gguf, symmetric, unpack_int4

SIZES = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176)}


def blocks(type_name: str, n_blocks: int, rng) -> np.ndarray:
    """Random blocks with finite float16 scales (the first two or four bytes), every other byte random."""
    block, size = SIZES[type_name]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    halves = 2 if type_name == "Q5_0" else 4
    raw[:, :halves] = rng.uniform(-2, 2, (n_blocks, halves // 2)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("type_name", list(SIZES))
@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 768), (1, 2048)])
def test_q5_types_import_bit_for_bit_at_their_own_size(type_name, rows, cols):
    rng = np.random.default_rng(rows * cols + len(type_name))
    block, size = SIZES[type_name]
    raw = blocks(type_name, rows * cols // block, rng)
    w = from_gguf(type_name, torch.from_numpy(raw), (rows, cols))
    assert isinstance(w, Int5KWeight if type_name == "Q5_K" else Int5Weight) and w.shape == (rows, cols)
    want = torch.from_numpy(ref_dequantize(raw.reshape(-1), GGMLQuantizationType[type_name]).reshape(rows, cols))
    assert torch.equal(w.dequantize(), want)
    extra = rows * cols // 64 if type_name == "Q5_K" else 0
    # Q5_0 holds a float16 bias a block (-16 d) where the file keeps none, which the CPU kernels do not read
    assert symmetric(w) == (type_name == "Q5_0") and w.nbytes == raw.nbytes + extra


def test_the_fifth_bits_lie_in_the_order_the_kernels_expand_a_blocks_nibbles():
    """Position e of a block: column 2e for e < 16 (byte e's low nibble), 2(e - 16) + 1 past it (a high one). Eight
    blocks a group of 32 bytes, byte e's bit j block j's; a block past a row's groups a little-endian uint32."""
    codes = torch.zeros(2, 256 + 64, dtype=torch.uint8)
    codes[0, 2 * 5] = codes[0, 32 * 3 + 2 * 7 + 1] = codes[1, 32 * 7 + 2 * 15 + 1] = 16  # grouped blocks 0, 3, 7
    codes[0, 256 + 2 * 3 + 1] = codes[1, 256 + 32 + 2 * 15 + 1] = 16  # the two blocks past the group
    _, fifth = split_codes(codes)
    assert fifth.shape == (2, 40)
    group = [[0] * 32, [0] * 32]
    group[0][5], group[0][16 + 7], group[1][16 + 15] = 1, 1 << 3, 1 << 7
    assert fifth[:, :32].tolist() == group
    words = fifth[:, 32:].contiguous().view(torch.int32)  # little-endian, one a block
    assert words[0].tolist() == [1 << (16 + 3), 0]
    assert words[1].tolist() == [0, -(1 << 31)]  # bit 31 (int32 sees it as the sign)
    g = torch.Generator().manual_seed(3)
    for k in (96, 256, 576, 1024):
        codes = torch.randint(0, 32, (7, k), generator=g, dtype=torch.uint8)
        packed, fifth = split_codes(codes)
        assert torch.equal(join_codes(packed, fifth), codes) and torch.equal(unpack_int4(packed), codes & 15)


@pytest.mark.parametrize("type_name", list(SIZES))
def test_the_gpus_int8_form_is_near_and_q5_0s_exact(type_name):
    rng = np.random.default_rng(9)
    block, _ = SIZES[type_name]
    w = from_gguf(type_name, torch.from_numpy(blocks(type_name, 8 * 512 // block, rng)), (8, 512))
    int8, want = w.to_int8(), w.dequantize()
    err = ((int8.dequantize() - want).norm() / want.norm()).item()
    assert int8.group == 32 and (err == 0 if type_name == "Q5_0" else err < 1e-2)


def test_malformed_5_bit_weights_are_one_line_errors():
    g = torch.Generator().manual_seed(1)
    w = Int5Weight.from_codes(torch.randint(0, 32, (4, 64), generator=g, dtype=torch.uint8),
                              torch.ones(4, 2, dtype=torch.float16), torch.zeros(4, 2, dtype=torch.float16))
    with pytest.raises(LocalpdError, match="fifth bits must be uint8"):
        Int5Weight(w.packed, w.fifth[:, :4], w.scales, w.biases)
    with pytest.raises(LocalpdError, match="a group of 32"):
        Int5Weight(w.packed, w.fifth, w.scales[:, :1], w.biases[:, :1])
    with pytest.raises(LocalpdError, match="multiple of 32"):
        split_codes(torch.zeros(2, 48, dtype=torch.uint8))


def test_a_quantized_directory_keeps_5_bit_weights(tmp_path):
    rng = np.random.default_rng(4)
    ws = {"a.q_proj": from_gguf("Q5_1", torch.from_numpy(blocks("Q5_1", 16, rng)), (2, 256)),
          "a.k_proj": from_gguf("Q5_K", torch.from_numpy(blocks("Q5_K", 2, rng)), (2, 256))}
    save_quantized(tmp_path / "m", ws, {}, "native", {})
    _, back, _ = load_quantized(tmp_path / "m", "cpu")
    for name, w in ws.items():
        assert type(back[name]) is type(w) and torch.equal(back[name].dequantize(), w.dequantize())


def test_a_directory_of_fifth_bits_a_block_at_a_time_loads_as_the_same_weight(tmp_path):
    """A quantized directory written when every block's fifth bits were a uint32 of their own (field `high`) loads
    with the same codes and factors, rows of whole groups and a row with blocks past them."""
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(6)
    ws = {"a.q_proj": from_gguf("Q5_0", torch.from_numpy(blocks("Q5_0", 2 * 18, rng)), (2, 576)),
          "a.k_proj": from_gguf("Q5_K", torch.from_numpy(blocks("Q5_K", 4, rng)), (2, 512))}
    save_quantized(tmp_path / "m", ws, {}, "native", {})
    tensors = load_file(str(tmp_path / "m" / TENSORS))
    for name, w in ws.items():
        del tensors[f"{name}.fifth"]
        tensors[f"{name}.high"] = bit_plane(w.codes(), 4)
        assert not torch.equal(tensors[f"{name}.high"], w.fifth)  # the layouts differ on these codes
    save_file(tensors, str(tmp_path / "m" / TENSORS))
    _, back, _ = load_quantized(tmp_path / "m", "cpu")
    for name, w in ws.items():
        got = back[name]
        assert type(got) is type(w) and all(torch.equal(getattr(got, f.name), getattr(w, f.name)) for f in fields(w))
