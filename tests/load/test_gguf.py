"""GGUF reading and block dequantization against the gguf package's numpy reference."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from localpd.errors import LocalpdError
from localpd.load.gguf import BLOCKS, GGUFFile, dequantize_blocks

Q = gguf.GGMLQuantizationType
# byte offsets of the f16 scale fields inside one block of each type localpd decodes with torch code of its own:
# random bytes there could be inf/nan (MXFP4's scale is a power-of-two byte, any value of which is finite)
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q5_0": [0], "Q5_1": [0, 2],
              "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}
COUNTS = [1, 3, 8, 17]
# extreme scales (-0.0, the largest finite float16 and its negative, the smallest subnormal) and codes (all bytes
# equal: every code the lowest, the highest, or one value)
EXTREME_SCALES = [-0.0, 65504.0, -65504.0, 2.0 ** -24]
EXTREME_BYTES = [0x00, 0xFF, 0x88, 0x5A]


def random_blocks(type_name: str, n_blocks: int, rng) -> np.ndarray:
    size = BLOCKS[type_name][1]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        halves = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16)
        raw[:, off:off + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw


def check(type_name: str, raw: np.ndarray):
    n = raw.size // BLOCKS[type_name][1] * BLOCKS[type_name][0]
    want = ref_dequantize(raw, Q[type_name]).reshape(-1)
    got = dequantize_blocks(type_name, torch.from_numpy(raw.copy()).view(torch.uint8), n)
    assert got.dtype == torch.float32 and got.shape == (n,)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))


@pytest.mark.parametrize("n_blocks", COUNTS)
@pytest.mark.parametrize("type_name", list(F16_FIELDS))
def test_random_block_bytes(type_name, n_blocks):
    rng = np.random.default_rng(n_blocks * 7 + len(type_name))
    check(type_name, random_blocks(type_name, n_blocks, rng))


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
def test_extreme_blocks(type_name):
    """Every pair of an extreme scale (in every scale field) and a block of equal bytes, and the MXFP4 scale bytes
    at both ends of their range."""
    size = BLOCKS[type_name][1]
    blocks = []
    for scale in EXTREME_SCALES:
        for byte in EXTREME_BYTES:
            raw = np.full(size, byte, dtype=np.uint8)
            for off in F16_FIELDS[type_name]:
                raw[off:off + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
            if type_name == "MXFP4":
                raw[0] = [0, 1, 2, 127, 254, 255][(len(blocks)) % 6]
            blocks.append(raw)
    check(type_name, np.stack(blocks))


@pytest.mark.parametrize("n_blocks", COUNTS)
@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"])
def test_quantized_random_floats(type_name, n_blocks):
    rng = np.random.default_rng(n_blocks)
    x = rng.standard_normal((n_blocks, 32)).astype(np.float32) * rng.uniform(0.01, 3.0, (n_blocks, 1)).astype(np.float32)
    raw = ref_quantize(x, Q[type_name])
    check(type_name, np.ascontiguousarray(raw).view(np.uint8))


def test_unsupported_type_names_type_and_tensor(tmp_path):
    path = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(path, "llama")
    size = gguf.GGML_QUANT_SIZES[Q.Q8_K][1]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((1, size), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    g = GGUFFile(path)
    assert g.tensor_type("blk.0.ffn_up.weight") == "Q8_K" and g.tensor_shape("blk.0.ffn_up.weight") == (1, 256)
    with pytest.raises(LocalpdError, match=r"unsupported GGUF tensor type Q8_K in blk\.0\.ffn_up\.weight; supported: F32"):
        g.dequantize("blk.0.ffn_up.weight")


@pytest.fixture(scope="module")
def real(default_gguf):
    return GGUFFile(default_gguf)


def test_real_metadata_and_shapes(real):
    m = real.metadata
    assert m["general.architecture"] == "llama" and m["llama.block_count"] == 30
    assert isinstance(m["tokenizer.ggml.tokens"], list) and len(m["tokenizer.ggml.tokens"]) == 49152
    assert len(real.tensor_names) == 272
    assert real.tensor_shape("token_embd.weight") == (49152, 576)
    assert real.tensor_shape("blk.0.ffn_down.weight") == (576, 1536)
    assert real.tensor_shape("output_norm.weight") == (576,)
    assert {real.tensor_type(n) for n in real.tensor_names} == {"Q4_1", "Q8_0", "F32"}
    assert real.raw("blk.0.attn_q.weight").dtype == np.uint8


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
                                  "blk.3.attn_norm.weight", "output_norm.weight"])
def test_real_tensors_match_reference(real, name):
    t = real._tensors[name]
    want = torch.from_numpy(np.array(ref_dequantize(t.data, t.tensor_type), dtype=np.float32))
    got = real.dequantize(name)
    assert got.shape == real.tensor_shape(name) == want.shape
    assert torch.equal(got, want)
    assert real.dequantize(name, torch.bfloat16).dtype == torch.bfloat16


def test_truncated_file(tmp_path, default_gguf):
    for n in (10, 5_000, default_gguf.stat().st_size - 1):
        bad = tmp_path / f"t{n}.gguf"
        with open(default_gguf, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read(n))
        with pytest.raises(LocalpdError, match=str(bad)) as e:
            GGUFFile(bad)
        assert "\n" not in str(e.value)


def test_not_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(LocalpdError, match="not a GGUF file"):
        GGUFFile(junk)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(LocalpdError, match="corrupt.gguf"):
        GGUFFile(corrupt)
    with pytest.raises(LocalpdError, match="not found"):
        GGUFFile(tmp_path / "missing.gguf")


def small_file(path, tensors) -> bytes:
    """A GGUF file of (name, uint8 blocks, type) tensors; returns its bytes."""
    w = gguf.GGUFWriter(path, "llama")
    for name, raw, qtype in tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path.read_bytes()


def patch_tensor_info(path, name: str, dims=None, type_id=None):
    """Rewrite a tensor's dims or type id in the header (its info follows its name: n_dims, dims, type, offset)."""
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    if dims is not None:
        assert len(dims) == n_dims
        data[at + 4:at + 4 + 8 * n_dims] = b"".join(int(d).to_bytes(8, "little") for d in dims)
    if type_id is not None:
        data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = int(type_id).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def q4_k_blocks(n_blocks: int) -> np.ndarray:
    return np.zeros((1, n_blocks * 144), dtype=np.uint8)


@pytest.mark.parametrize("case, dims, type_id, message", [
    ("unknown type", None, 99, r"tensor blk\.0\.ffn_up\.weight has type id 99, which is not a ggml type"),
    ("not whole blocks", (576, 1), None, r"tensor blk\.0\.ffn_up\.weight \(Q4_K\) has rows of 576 values, not whole blocks"),
    ("too many bytes", (512, 2), None, r"tensor blk\.0\.ffn_up\.weight \(Q4_K, shape \[512, 2\]\) needs 576 bytes, "
                                       r"which run into tensor blk\.0\.ffn_down\.weight"),
])
def test_bad_tensor_is_one_line_naming_it(tmp_path, case, dims, type_id, message):
    path = tmp_path / "bad.gguf"
    small_file(path, [("blk.0.ffn_up.weight", q4_k_blocks(2), Q.Q4_K), ("blk.0.ffn_down.weight", q4_k_blocks(2), Q.Q4_K)])
    GGUFFile(path)  # readable as written
    patch_tensor_info(path, "blk.0.ffn_up.weight", dims, type_id)
    with pytest.raises(LocalpdError, match=message) as e:
        GGUFFile(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "short.gguf"
    data = small_file(path, [("blk.0.ffn_up.weight", q4_k_blocks(2), Q.Q4_K), ("blk.0.ffn_down.weight", q4_k_blocks(2), Q.Q4_K)])
    path.write_bytes(data[:-100])
    with pytest.raises(LocalpdError, match=r"short\.gguf is truncated: tensor blk\.0\.ffn_down\.weight ends at byte"):
        GGUFFile(path)
