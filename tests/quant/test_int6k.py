"""6-bit weights (quant/int6k.py): Q6_K blocks import bit for bit as gguf's own dequantization reads them, at the
file's bytes (and 2 more a super-block: nothing else); Q3_K's and Q2_K's as nibbles; the GPU's int8 form is near;
malformed tensors are one-line errors; a quantized directory keeps the format."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize

from localpd.errors import LocalpdError
from localpd.quant.int5 import bit_plane
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight, upper_codes, upper_plane
from localpd.quant.store import TENSORS, load_quantized, save_quantized
from localpd.quant.weights import from_gguf


def last_d_blocks(n_blocks: int, size: int, rng) -> np.ndarray:
    """Random blocks of `size` bytes whose last two, the float16 d, are finite (Q6_K's and Q3_K's layout)."""
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    raw[:, size - 2:] = rng.uniform(-2, 2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def q6_k_blocks(n_blocks: int, rng) -> np.ndarray:
    return last_d_blocks(n_blocks, 210, rng)


def q3_k_blocks(n_blocks: int, rng) -> np.ndarray:
    return last_d_blocks(n_blocks, 110, rng)


def q2_k_blocks(n_blocks: int, rng) -> np.ndarray:
    """Random Q2_K blocks (84 bytes: scales and minima, codes, d, dmin) whose d and dmin are finite."""
    raw = last_d_blocks(n_blocks, 84, rng)
    raw[:, 80:82] = rng.uniform(-2, 2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 768), (1, 4096)])
def test_q6_k_imports_bit_for_bit_at_its_own_size(rows, cols):
    rng = np.random.default_rng(rows * cols)
    raw = q6_k_blocks(rows * cols // 256, rng)
    w = from_gguf("Q6_K", torch.from_numpy(raw), (rows, cols))
    assert isinstance(w, Int6KWeight) and w.shape == (rows, cols)
    want = torch.from_numpy(ref_dequantize(raw.reshape(-1), GGMLQuantizationType.Q6_K).reshape(rows, cols))
    assert torch.equal(w.dequantize(), want)
    assert w.nbytes == raw.nbytes and w.nbytes * 8 / (rows * cols) == 6.5625


@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 768), (1, 4096)])
def test_q3_k_imports_bit_for_bit_as_nibbles(rows, cols):
    """Q3_K's d x (sc3 - 32) x (q3 - 4) is d x sc x (q - 8) at q = q3 + 4 (a nibble), sc = sc3 - 32: every value as
    gguf's own dequantization reads it (random bytes: every bit of the high-bit mask and of the packed six-bit
    scales), the codes within 4..11 and the scales the six bits' range, at 4.56 bits a weight; its 6-bit form (what
    GGUF export writes) holds the same values."""
    rng = np.random.default_rng(rows + cols)
    raw = q3_k_blocks(rows * cols // 256, rng)
    w = from_gguf("Q3_K", torch.from_numpy(raw), (rows, cols))
    assert isinstance(w, Int3KWeight) and w.shape == (rows, cols)
    want = torch.from_numpy(ref_dequantize(raw.reshape(-1), GGMLQuantizationType.Q3_K).reshape(rows, cols))
    assert torch.equal(w.dequantize(), want) and torch.equal(w.as_6_bit().dequantize(), want)
    codes = w.codes()
    assert codes.min() >= 4 and codes.max() <= 11 and w.sc.min() >= -32 and w.sc.max() <= 31
    assert w.nbytes * 8 / (rows * cols) == 4.5625


@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 768), (1, 4096)])
def test_q2_k_imports_bit_for_bit_as_nibbles_with_minima(rows, cols):
    """Q2_K's d x sc x q - dmin x m: every value as gguf's own dequantization reads it (random bytes: every code,
    scale and minimum), codes 0..3 in nibbles and sc, m 0..15 a byte each, at 5.125 bits a weight; its blocks come
    back byte for byte (what GGUF export writes)."""
    rng = np.random.default_rng(rows * 3 + cols)
    raw = q2_k_blocks(rows * cols // 256, rng)
    w = from_gguf("Q2_K", torch.from_numpy(raw), (rows, cols))
    assert isinstance(w, Int2KWeight) and w.shape == (rows, cols)
    want = torch.from_numpy(ref_dequantize(raw.reshape(-1), GGMLQuantizationType.Q2_K).reshape(rows, cols))
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(w.to_q2_k(), torch.from_numpy(raw))
    codes = w.codes()
    assert codes.max() == 3 and min(w.sc.min(), w.mn.min()) >= 0 and max(w.sc.max(), w.mn.max()) == 15
    assert w.nbytes * 8 / (rows * cols) == 5.125


def test_the_gpus_int8_form_is_near():
    w = from_gguf("Q6_K", torch.from_numpy(q6_k_blocks(16, np.random.default_rng(2))), (8, 512))
    int8, want = w.to_int8(), w.dequantize()
    assert int8.group == 32 and ((int8.dequantize() - want).norm() / want.norm()).item() < 1e-2


def test_malformed_6_bit_weights_are_one_line_errors():
    w = from_gguf("Q6_K", torch.from_numpy(q6_k_blocks(2, np.random.default_rng(3))), (1, 512))
    with pytest.raises(LocalpdError, match="sc must be"):
        Int6KWeight(w.packed, w.upper, w.d, w.sc[:, :4])
    with pytest.raises(LocalpdError, match="multiple of 256"):
        Int6KWeight(w.packed[:, :16], w.upper[:, :32], w.d[:, :1], w.sc[:, :8])


def test_a_quantized_directory_keeps_6_bit_weights(tmp_path):
    w = from_gguf("Q6_K", torch.from_numpy(q6_k_blocks(4, np.random.default_rng(4))), (2, 512))
    save_quantized(tmp_path / "m", {"a.v_proj": w}, {}, "native", {})
    _, back, _ = load_quantized(tmp_path / "m", "cpu")
    assert type(back["a.v_proj"]) is Int6KWeight and torch.equal(back["a.v_proj"].dequantize(), w.dequantize())


def test_upper_bits_sit_where_the_kernels_expand_each_code():
    """`upper`: block 4g + j's code at position e (column 2e for e < 16, 2 (e - 16) + 1 after) has its bits 4, 5 in
    byte 32g + e at bits 2j, 2j + 1; every code (random, all 64 values) comes back from the plane."""
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 64, (3, 512), generator=g, dtype=torch.uint8)
    assert torch.equal(upper_codes(upper_plane(codes)), codes >> 4)
    one = torch.zeros(2, 256, dtype=torch.uint8)
    for row, (block, column, bits) in enumerate([(5, 7, 2), (2, 16, 3)]):  # block 5: group 1, j 1; block 2: j 2
        one[row, 32 * block + column] = bits << 4
    plane = upper_plane(one)
    assert plane.shape == (2, 64) and plane.count_nonzero() == 2
    assert plane[0, 32 + 16 + 3] == 2 << 2  # column 7: position 16 + 3
    assert plane[1, 8] == 3 << 4            # column 16: position 8
    w = Int6KWeight.from_codes(codes, torch.ones(3, 2, dtype=torch.float16), torch.ones(3, 32, dtype=torch.int8))
    assert torch.equal(w.codes(), codes) and w.nbytes * 8 / codes.numel() == 6.5625


def test_a_directory_of_bit_planes_loads_as_the_same_weight(tmp_path):
    """A quantized directory written when Q6_K's upper bits were two planes of a bit (fields high, top) loads with
    the same codes, d and scales."""
    from safetensors.torch import load_file, save_file

    w = from_gguf("Q6_K", torch.from_numpy(q6_k_blocks(4, np.random.default_rng(7))), (2, 512))
    save_quantized(tmp_path / "m", {"a.v_proj": w}, {}, "native", {})
    tensors = load_file(str(tmp_path / "m" / TENSORS))
    del tensors["a.v_proj.upper"]
    codes = w.codes()
    tensors["a.v_proj.high"], tensors["a.v_proj.top"] = bit_plane(codes, 4), bit_plane(codes, 5)
    save_file(tensors, str(tmp_path / "m" / TENSORS))
    _, back, _ = load_quantized(tmp_path / "m", "cpu")
    got = back["a.v_proj"]
    assert all(torch.equal(getattr(got, f), getattr(w, f)) for f in ("packed", "upper", "d", "sc"))


@pytest.mark.parametrize("name,blocks,cls", [("Q3_K", q3_k_blocks, Int3KWeight), ("Q2_K", q2_k_blocks, Int2KWeight)])
def test_a_quantized_directory_keeps_q3_k_and_q2_k_weights(tmp_path, name, blocks, cls):
    w = from_gguf(name, torch.from_numpy(blocks(4, np.random.default_rng(5))), (2, 512))
    save_quantized(tmp_path / "m", {"a.v_proj": w}, {}, "native", {})
    _, back, _ = load_quantized(tmp_path / "m", "cpu")
    assert type(back["a.v_proj"]) is cls and torch.equal(back["a.v_proj"].dequantize(), w.dequantize())


def test_malformed_q2_k_minima_are_one_line_errors():
    w = from_gguf("Q2_K", torch.from_numpy(q2_k_blocks(2, np.random.default_rng(8))), (1, 512))
    with pytest.raises(LocalpdError, match="mn must be"):
        Int2KWeight(w.packed, w.d, w.dmin, w.sc, w.mn[:, :4])
    with pytest.raises(LocalpdError, match="dmin must be"):
        Int2KWeight(w.packed, w.d, w.dmin.float(), w.sc, w.mn)
