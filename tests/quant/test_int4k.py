"""int4-k (quant/int4k.py): Q4_K's blocks import bit for bit; quantizing keeps int4-g32's accuracy at fewer bytes;
malformed tensors are one-line errors; a quantized directory keeps the format."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize

from localpd.errors import LocalpdError
from localpd.quant.int4k import Int4KWeight
from localpd.quant.weights import Int4Weight, from_gguf


def q4_k_blocks(n_blocks: int, rng, extreme: bool = False) -> np.ndarray:
    """Random Q4_K blocks (144 bytes) with finite float16 d and dmin; extreme: the largest float16 d and dmin,
    -0.0, and every six-bit scale and min at 63 (all ones)."""
    raw = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    halves = rng.uniform(-2, 2, (n_blocks, 2)).astype(np.float16)
    if extreme:
        halves[0] = [65504.0, -0.0]
        halves[1] = [-0.0, 65504.0]
        raw[2, 4:16] = 255
    raw[:, 0:4] = halves.view(np.uint8).reshape(n_blocks, 4)
    return raw


@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 768), (1, 2048)])
@pytest.mark.parametrize("extreme", [False, True])
def test_q4_k_imports_bit_for_bit(rows, cols, extreme):
    rng = np.random.default_rng(rows * cols + extreme)
    raw = q4_k_blocks(rows * cols // 256, rng, extreme)
    w = from_gguf("Q4_K", torch.from_numpy(raw), (rows, cols))
    assert isinstance(w, Int4KWeight) and w.shape == (rows, cols)
    want = torch.from_numpy(ref_dequantize(raw.reshape(-1), GGMLQuantizationType.Q4_K).reshape(rows, cols))
    assert torch.equal(w.dequantize(), want)
    assert w.nbytes == raw.nbytes + rows * cols // 64  # half a byte more a group: eight-bit scales, not six


@pytest.mark.parametrize("n,k", [(64, 576), (33, 1536), (7, 96)])
def test_quantize_is_as_accurate_as_int4_g32_in_fewer_bytes(n, k):
    """The groups' float16 scales and biases quantized within super-blocks cost at most 2% more squared error than
    int4-g32's, in fewer bytes: 4.625 bits a weight where the rows are whole super-blocks, int4-g32's 5."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * torch.linspace(0.2, 3, k)
    g32, q = Int4Weight.quantize(w, 32), Int4KWeight.quantize(w)
    err_g32, err_k = (g32.dequantize() - w).pow(2).mean(), (q.dequantize() - w).pow(2).mean()
    assert err_k <= 1.02 * err_g32
    assert q.nbytes < g32.nbytes and (k % 256 or q.nbytes * 8 / w.numel() == 4.625)


def test_from_int4_keeps_a_q4_1_import_close():
    """An int4-g32 weight (a Q4_0/Q4_1 file's blocks) re-expressed: the codes re-rounded to the quantized scales;
    its values stay within a small fraction of a 4-bit step."""
    w = Int4Weight.quantize_rtn(torch.randn(40, 512, generator=torch.Generator().manual_seed(3)), 32)
    k = Int4KWeight.from_int4(w)
    step = w.scales.float().repeat_interleave(32, dim=1)
    assert ((k.dequantize() - w.dequantize()).abs() / step).mean() < 0.05


def test_malformed_tensors_are_one_line_errors():
    w = Int4KWeight.quantize(torch.randn(4, 320))
    with pytest.raises(LocalpdError, match="int4-k sub must be torch.uint8"):
        Int4KWeight(w.packed, w.d, w.dmin, w.sub[:, :-1])
    with pytest.raises(LocalpdError, match="int4-k d must be torch.float16"):
        Int4KWeight(w.packed, w.d.float(), w.dmin, w.sub)
    with pytest.raises(LocalpdError, match="multiple of 32"):
        Int4KWeight(torch.zeros(4, 2, dtype=torch.int32), w.d, w.dmin, w.sub)


def test_a_quantized_directory_keeps_the_format(tmp_path):
    from dataclasses import asdict

    from localpd.model.config import ModelConfig
    from localpd.quant.store import load_quantized, save_quantized

    config = ModelConfig("llama", vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128)
    w = Int4KWeight.quantize(torch.randn(128, 64))
    save_quantized(tmp_path / "m", {"layers.0.mlp.up_proj": w}, asdict(config), "int4-k", {})
    _, weights, meta = load_quantized(tmp_path / "m", "cpu")
    got = weights["layers.0.mlp.up_proj"]
    assert meta["scheme"] == "int4-k" and isinstance(got, Int4KWeight)
    assert torch.equal(got.dequantize(), w.dequantize())
