"""Where a model holds an int4 matrix for torch's tinygemm (kernels/tinygemm.py's measured table): the table made
from bench kernels' rows, read back per card and shape, and a model built with it (under Triton's interpreter)."""

import json
import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the K-major GEMVs of the other shapes)

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels import tinygemm  # noqa: E402
from localpd.model.transformer import gpu_form  # noqa: E402
from localpd.quant.kmajor import KMajorWeight, KStripWeight  # noqa: E402
from localpd.quant.tinygemm import TinyGemmInt4  # noqa: E402
from localpd.quant.weights import Int4Weight, Int8Weight  # noqa: E402
from tests.kernels.test_fused_kernels import count_decode_launches, rel_err  # noqa: E402


def row(n, k, m, kmajor, strips, peer):
    cells = {"int4-g128 K-major": (kmajor * 1e-6, 1), "int4-g128 strips": (strips * 1e-6, 1),
             "tinygemm int4-g128": peer if isinstance(peer, str) else (peer * 1e-6, 1)}
    return {"shape": "s", "n": n, "k": k, "m": m, "cells": cells, "rel_err": {}}


def test_the_table_holds_shapes_tinygemm_ran_faster_at_one_row_and_no_slower_at_more():
    rows = [row(4096, 4096, 1, 7.4, 4.9, 7.0), row(4096, 4096, 16, 9.0, 8.0, 8.5),  # faster than K-major only
            row(6144, 4096, 1, 8.5, 6.0, 8.4), row(6144, 4096, 16, 9.0, 8.0, 8.5),  # within the 3% margin
            row(4096, 14336, 1, 14.9, 12.0, 11.0), row(4096, 14336, 512, 40.0, 41.0, 60.0),  # slower for prefill
            row(28672, 4096, 1, 23.8, 20.0, 19.0), row(28672, 4096, 4, 30.0, 29.0, 28.0),  # faster than both
            row(128256, 4096, 1, 99.0, 98.0, "n/a (GPU only)")]  # tinygemm did not run
    assert tinygemm.wins(rows) == {"kmajor": ["4096:4096:128", "28672:4096:128"], "strip": ["28672:4096:128"]}
    assert tinygemm.wins([row(4096, 4096, 4, 9.0, 8.0, 1.0)]) == {}  # no one-row time: no entry


def test_a_model_reads_the_table_for_its_card_and_gemv_only(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"other card": {"strip": ["1:1:1"]}}))
    tinygemm.write(path, "card", {"kmajor": ["48:512:32"]})
    assert json.loads(path.read_text()) == {"card": {"kmajor": ["48:512:32"]}, "other card": {"strip": ["1:1:1"]}}
    monkeypatch.setattr(tinygemm, "TABLE", path)
    assert tinygemm.measured_faster("card", "kmajor", (48, 512), 32)
    assert not tinygemm.measured_faster("card", "strip", (48, 512), 32)
    assert not tinygemm.measured_faster("other card", "kmajor", (48, 512), 32)
    assert not tinygemm.measured_faster("card", "kmajor", (48, 512), 64)
    g = torch.Generator().manual_seed(1)
    w = Int4Weight.quantize_rtn(torch.randn(48, 512, generator=g), 32)
    assert isinstance(gpu_form(w, "card", False, torch.float32), TinyGemmInt4)
    assert isinstance(gpu_form(w, "card", False, torch.float32, rows_read=True), KMajorWeight)  # a tied head
    assert isinstance(gpu_form(w, "card", True, torch.float32), KStripWeight)  # measured against K-major, not strips
    assert isinstance(gpu_form(w, "other card", False, torch.float32), KMajorWeight)
    assert isinstance(gpu_form(Int8Weight.quantize(torch.randn(48, 512, generator=g)), "card", False, torch.float32),
                      KMajorWeight)


@pytest.mark.skipif(DEV != "cpu", reason="counts the interpreter's launches")
def test_a_decode_step_runs_the_tables_shapes_on_tinygemm(tmp_path, monkeypatch):
    """The tiny model with its qkv and o shapes in the table (card "": the interpreter's): those two products run
    on torch's kernel, the other GEMVs and every other launch as before, the logits those of the K-major GEMVs."""
    _, kmajor_logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True)
    path = tmp_path / "t.json"
    tinygemm.write(path, "", {"kmajor": ["512:128:32", "128:256:32"]})
    monkeypatch.setattr(tinygemm, "TABLE", path)
    launched, logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True)
    layer = ["add_rms_norm_kernel", "rope_write_kv_kernel", "decode_kernel", "decode_reduce_kernel",
             "add_rms_norm_kernel", "_gemv_kmajor_kernel", "act_mul_kernel", "_gemv_kmajor_kernel"]
    assert launched == layer * 2 + ["add_rms_norm_kernel", "_gemv_kmajor_kernel"]
    assert rel_err(logits, kmajor_logits) < 1e-5
