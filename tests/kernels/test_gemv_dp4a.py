"""The integer-dot-product GEMV (kernels/gemv_dp4a.py) against its torch reference, in Triton's interpreter on the
CPU (LOCALPD_TEST_DEVICE=cuda runs them on a GPU); its compiled code: tests/measure/test_predict.py."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km  # noqa: E402
from tests.kernels.test_act_round import act_rows  # noqa: E402
from localpd.kernels.dispatch import kmajor_matmul_ref, linear_kmajor  # noqa: E402
from localpd.quant.kmajor import to_kmajor  # noqa: E402
from localpd.quant.weights import Int4Weight, Int8Weight  # noqa: E402


@pytest.fixture(autouse=True)
def triton_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def weight(fmt: str, n: int, k: int, group: int | None, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    q = Int4Weight.quantize_rtn(w, group) if fmt == "int4" else Int8Weight.quantize(w, group)
    kw = to_kmajor(q)
    return q, type(kw)(kw.words.to(DEV), kw.factors.to(DEV))


def activations(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return act_rows(m, k, seed, dtype).to(DEV)


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", None), ("int8", 64)])
@pytest.mark.parametrize("n,k,m,split", [(200, 256, 1, None), (130, 576, 3, 3), (72, 384, 5, 1), (40, 128, 8, 2)])
def test_gemv_matches_the_reference(fmt, group, n, k, m, split):
    """Partial column tiles, K of 2 and 4 blocks a trip (576 = 18 blocks: 2 a trip), groups of one block and of
    four, per-channel int8, 1-8 rows (a program of 4 and a padded one), split-K reduced inside the launch, a bias:
    the product is the rounded activations times the dequantized weights (float64 reference) to float32 rounding,
    and within the rounding's 15 bits of the exact product."""
    if group and k % group:
        group = 32
    q, kw = weight(fmt, n, k, group, seed=n + k)
    x, bias = activations(m, k, seed=k), torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEV)
    y = dp.gemv_dp4a(x, kw.words, kw.factors, kw.BITS, kw.group, bias=bias, split_k=split)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert rel_err(y, dp.gemv_dp4a_ref(x, kw.words, kw.factors, kw.BITS, kw.group, bias=bias)) < 1e-6
    assert rel_err(y, kmajor_matmul_ref(x, kw, bias)) < 1e-4
    assert rel_err(y, kmajor_matmul_ref(x, kw)) > 1e-3  # the bias counts
    _, cnt = km.workspace(x.device, 0, 0)
    assert not cnt.any()  # the last program of each tile left its counter at zero for the next launch


@pytest.mark.parametrize("m,split,rows,n", [(2, 1, (0, 1), 136), (5, 3, range(5), 136), (16, 2, (3, 12), 72)])
def test_rows_sharing_a_program_are_each_rows_own_product(m, split, rows, n):
    """Up to 4 rows share a program's words (2 exactly; 5 in a full program and a padded one; 16, MAX_ROWS, in
    four programs, rows of the first and last checked): each row's output is bit for bit what the row alone
    gives."""
    k = 256
    _, kw = weight("int4", n, k, 64, seed=m)
    x = activations(m, k, seed=m + 1)
    y = dp.gemv_dp4a(x, kw.words, kw.factors, 4, 64, split_k=split)
    for r in rows:
        assert torch.equal(y[r:r + 1], dp.gemv_dp4a(x[r:r + 1], kw.words, kw.factors, 4, 64, split_k=split)), r


@pytest.mark.parametrize("tile", [dict(PREFETCH=0), dict(PREFETCH=2, blocks=2, num_warps=2, per_sm=12),
                                  dict(PREFETCH=2, blocks=8, num_warps=4, per_sm=4), dict(PREFETCH=0, stages=3)])
def test_every_launch_tile_computes_the_same_product(tile):
    """The knobs scripts/sweep_dp4a.py times (trips loaded ahead: 0-2, including slices of one or two trips, where
    the loads ahead repeat the last trip's; blocks a trip; warps; programs an SM; the pipeliner's stages, which the
    interpreter does not pipeline: their copies are checked in tests/measure/test_predict.py) change the speed, not
    the product (bit for bit where the blocks a trip are the same: they set the order of the float sums)."""
    for fmt, group, n, k in (("int4", 128, 72, 768), ("int8", None, 40, 512)):
        _, kw = weight(fmt, n, k, group, seed=k)
        x = activations(2, k, seed=n)
        y = dp.gemv_dp4a(x, kw.words, kw.factors, kw.BITS, kw.group, split_k=3, tile=tile)
        assert rel_err(y, dp.gemv_dp4a_ref(x, kw.words, kw.factors, kw.BITS, kw.group)) < 1e-6
        if tile.get("blocks", dp.DEFAULT_TILE["blocks"]) == dp.DEFAULT_TILE["blocks"]:
            assert torch.equal(y, dp.gemv_dp4a(x, kw.words, kw.factors, kw.BITS, kw.group, split_k=3))


@pytest.mark.parametrize("split", [1, 3, 8])
def test_the_next_trips_activations_loaded_ahead_leave_the_product_bit_for_bit(split):
    """The acts knob (one row): each trip's activations and factors loaded a trip ahead, the last trip loading its
    own again, change when they are loaded, not a sum: the same product bit for bit, at slices of several trips, of
    two and of one (8 slices of 8 trips), int4 groups and int8, and rows past one ignore it."""
    for fmt, group, n, k in (("int4", 128, 72, 1024), ("int8", None, 40, 1024)):
        _, kw = weight(fmt, n, k, group, seed=k + split)
        x = activations(2, k, seed=n + split)
        for tile in (dict(acts=1), dict(acts=1, PREFETCH=2, blocks=4, num_warps=4)):
            plain = {**tile, "acts": 0}
            y = dp.gemv_dp4a(x[:1], kw.words, kw.factors, kw.BITS, kw.group, split_k=split, tile=tile)
            assert torch.equal(y, dp.gemv_dp4a(x[:1], kw.words, kw.factors, kw.BITS, kw.group, split_k=split,
                                               tile=plain))
            assert rel_err(y, dp.gemv_dp4a_ref(x[:1], kw.words, kw.factors, kw.BITS, kw.group)) < 1e-6
            assert torch.equal(dp.gemv_dp4a(x, kw.words, kw.factors, kw.BITS, kw.group, split_k=split, tile=tile),
                               dp.gemv_dp4a(x, kw.words, kw.factors, kw.BITS, kw.group, split_k=split, tile=plain))


def test_the_model_linear_takes_it_for_16_bit_activations_only():
    """linear_kmajor: bfloat16 activations go through this GEMV (its product equals gemv_dp4a's), up to MAX_ROWS
    rows (past gemv_kmajor's), float32 ones through gemv_kmajor's float product; ENABLED = False sends bfloat16
    there too."""
    _, kw = weight("int4", 96, 256, 128, seed=5)
    x = activations(2, 256, seed=6, dtype=torch.bfloat16)
    assert dp.MAX_ROWS > km.MAX_ROWS
    launched = []  # the rows each launch of the integer GEMV takes (its product is tested above)
    real, dp.gemv_rounded = dp.gemv_rounded, lambda q, s, out, *a, **kw: launched.append(out.shape[0]) or out
    try:
        for m in (dp.MAX_ROWS, dp.MAX_ROWS + 1):
            linear_kmajor(activations(m, 256, seed=7, dtype=torch.bfloat16), kw)
    finally:
        dp.gemv_rounded = real
    assert launched == [dp.MAX_ROWS]  # past MAX_ROWS: cuBLAS over the dequantized weight
    assert dp.takes(kw.shape, 4, 128, torch.bfloat16) and not dp.takes(kw.shape, 4, 128, torch.float32)
    assert not dp.takes((96, 80), 4, 80, torch.bfloat16)  # K not whole blocks
    assert torch.equal(linear_kmajor(x, kw), dp.gemv_dp4a(x, kw.words, kw.factors, 4, 128))
    x32 = x.float()
    assert torch.equal(linear_kmajor(x32, kw), km.gemv_kmajor(x32, kw.words, kw.factors, 4, 128))
    dp.ENABLED = False
    try:
        assert torch.equal(linear_kmajor(x, kw), km.gemv_kmajor(x, kw.words, kw.factors, 4, 128))
    finally:
        dp.ENABLED = True


def test_the_measured_tile_table_holds_launchable_tiles():
    """kernels/gemv_dp4a_tiles.json (scripts/sweep_dp4a.py --table): per card, shapes "bits:N:K" to tiles with the
    launch's six knobs; a tile that does not divide K's blocks still launches (blocks_a_trip halves it)."""
    import json

    table = json.loads(dp.TILE_TABLE.read_text())
    assert table and all(table.values())
    for card in table.values():
        for shape, tile in card.items():
            bits, n, k = map(int, shape.split(":"))
            assert bits in (4, 8) and n > 0 and k % 32 == 0
            assert set(tile) == set(dp.DEFAULT_TILE) and tile["blocks"] in (1, 2, 4, 8, 16)
            assert tile["num_warps"] <= tile["blocks"] and tile["per_sm"] >= 1 and tile["stages"] >= 1
    assert dp.blocks_a_trip(18 * 32, 8) == 2 and dp.tile_for(torch.device("cpu"), 4, 64, 64, 1) == dp.DEFAULT_TILE
