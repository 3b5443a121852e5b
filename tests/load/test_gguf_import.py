"""localpd/load/gguf_import.py (kernels/gguf_import.c) against the torch import it stands in for, and
localpd/load/placement.py's arena: the model's fused matrices made in place, nothing left for gather_weights."""

from dataclasses import fields

import numpy as np
import pytest
import torch

from localpd.errors import LocalpdError
from localpd.kernels import cpu
from localpd.load import gguf_import
from localpd.load.gguf import BLOCKS
from localpd.load.loader import load_model, rows
from localpd.kvcache.formats import new_kv_pool
from localpd.model.transformer import Batch, Transformer
from localpd.quant.weights import from_gguf

pytestmark = pytest.mark.skipif(not gguf_import.available(), reason="the C import is not built here (no compiler)")

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [], "Q2_K": [80, 82]}
# float16 scales at the edges: -0.0, the smallest subnormal, a subnormal, a large one whose -16 d (Q5_0) and
# d (ls - 32) (IQ4_XS) float16 still holds
EDGES = np.array([-0.0, 2.0 ** -24, -3.0 * 2.0 ** -20, 2046.0], dtype=np.float16)
MXFP4_EDGES = np.array([0, 1, 2, 143], dtype=np.uint8)  # its scale byte e: 2^(e - 128), float16 up to 143


def blocks(type_name: str, n: int, k: int, rng) -> np.ndarray:
    """Random stored blocks of an n x k matrix, their scales finite in float16 (edge values among them); IQ4_XS's
    scales (d times a six-bit integer) and MXFP4's (powers of two) are rounded to float16 by the import."""
    block, size = BLOCKS[type_name]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        halves = rng.uniform(-0.05, 0.05, len(raw)).astype(np.float16)
        halves[rng.integers(0, len(raw), 4)] = EDGES
        raw[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":
        raw[:, 0] = rng.integers(0, 144, len(raw))
        raw[rng.integers(0, len(raw), 4), 0] = MXFP4_EDGES
    return raw


def assert_same(a, b):
    assert type(a) is type(b)
    for f in fields(b):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f.name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f.name


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
@pytest.mark.parametrize("n, blocks_a_row", [(1, 1), (3, 3), (17, 2)])
@pytest.mark.parametrize("reordered", [False, True])
def test_the_c_import_is_the_torch_import_bit_for_bit(type_name, n, blocks_a_row, reordered):
    rng = np.random.default_rng(n * 31 + blocks_a_row + len(type_name) + 7 * reordered)
    k = blocks_a_row * BLOCKS[type_name][0]
    raw = blocks(type_name, n, k, rng)
    order = torch.from_numpy(rng.permutation(n)) if reordered else None
    got = gguf_import.import_matrix(type_name, raw, (n, k), order)
    want = from_gguf(type_name, torch.from_numpy(raw.copy()), (n, k))
    assert_same(got, want if order is None else rows(want, order))


def test_it_writes_into_the_tensors_it_is_given():
    rng = np.random.default_rng(1)
    raw = blocks("Q6_K", 5, 512, rng)
    out = [torch.full(shape, 7, dtype=dtype) for dtype, shape in gguf_import.field_specs("Q6_K", (5, 512))]
    w = gguf_import.import_matrix("Q6_K", raw, (5, 512), out=out)
    assert all(getattr(w, f.name) is t for f, t in zip(fields(w), out))
    assert_same(w, from_gguf("Q6_K", torch.from_numpy(raw.copy()), (5, 512)))


def test_what_it_does_not_take_goes_to_the_torch_import():
    rng = np.random.default_rng(2)
    raw = blocks("Q4_0", 2, 64, rng)
    assert gguf_import.import_matrix("Q4_0", raw[:-1], (2, 64)) is None  # bytes that do not fit the shape
    assert gguf_import.import_matrix("Q4_0", raw, (2, 64), torch.tensor([0, 2])) is None  # a row not in the file
    assert gguf_import.import_matrix("IQ2_XS", raw, (2, 64)) is None  # a type it has no code for
    wrong = [torch.empty(s, dtype=torch.float32) for _, s in gguf_import.field_specs("Q4_0", (2, 64))]
    assert gguf_import.import_matrix("Q4_0", raw, (2, 64), out=wrong) is None
    raw[1, 0:2] = np.array([65504.0], dtype=np.float16).view(np.uint8)  # -8 d does not fit float16
    assert gguf_import.import_matrix("Q4_0", raw, (2, 64)) is None
    with pytest.raises(LocalpdError, match="does not fit float16"):
        from_gguf("Q4_0", torch.from_numpy(raw.copy()), (2, 64))
    raw = blocks("Q8_0", 2, 64, rng)
    raw[0, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert gguf_import.import_matrix("Q8_0", raw, (2, 64)) is None
    raw = blocks("MXFP4", 2, 64, rng)
    raw[1, 0] = 144  # 2^16
    assert gguf_import.import_matrix("MXFP4", raw, (2, 64)) is None
    with pytest.raises(LocalpdError, match="does not fit float16"):
        from_gguf("MXFP4", torch.from_numpy(raw.copy()), (2, 64))


def test_a_load_makes_the_fused_matrices_in_place_and_leaves_nothing_to_gather(default_gguf, monkeypatch):
    """The default model's q/k/v and gate/up are made as one matrix each in the load's arena, joined by the model
    without a copy; its logits are the torch import's (LOCALPD_C_IMPORT=0) bit for bit."""
    loaded = load_model(default_gguf)
    parts = [loaded.weights[f"layers.0.{p}_proj"] for p in "qkv"]
    model = Transformer(loaded.config, loaded.weights, consume=True)
    qkv = model.layers[0].qkv.weight
    assert qkv.packed.data_ptr() == parts[0].packed.data_ptr()
    assert qkv.packed.shape[0] == sum(p.packed.shape[0] for p in parts)
    linears = [lin.weight for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down)]
    assert all(cpu.in_arena(getattr(w, f.name)) for w in linears + [model.embed] for f in fields(w))
    ids = list(range(100, 140))

    def logits(m):
        pool = new_kv_pool("fp32", m.config.n_layers, 3, 16, m.config.n_kv_heads, m.config.head_dim, m.dtype, m.device)
        return m.forward(Batch.single(ids, 0, pool.k.shape[1], 16, m.device, all_logits=True), pool)

    got = logits(model)
    monkeypatch.setenv("LOCALPD_C_IMPORT", "0")
    torch_loaded = load_model(default_gguf)
    assert not cpu.in_arena(torch_loaded.weights["layers.0.q_proj"].packed)
    want = logits(Transformer(torch_loaded.config, torch_loaded.weights, consume=True))
    assert torch.equal(got, want)
