"""Activation importance (localpd.quantize.calibrate) and int4 quantization weighted by it."""

import json
from pathlib import Path

import pytest
import torch
from localpd.quant.weights import Int4Weight

from localpd.quantize.calibrate import calibrate, calibrate_text, default_text
from localpd.cli.main import main
from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.load.loader import imports_every_matrix_exactly, load_model
from localpd.model.linear import QuantLinear
from localpd.model.transformer import Transformer
from localpd.measure.perplexity import perplexity
from localpd.engine.sampling import SamplingParams


def weighted_error(q: Int4Weight, w: torch.Tensor, h: torch.Tensor) -> float:
    return (h * (q.dequantize() - w) ** 2).sum().item()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_importance_lowers_the_error_it_weighs(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(48, 384, generator=g)
    h = torch.rand(384, generator=g) ** 4 * 100  # a few columns matter far more than the rest, as in real layers
    plain, weighted = Int4Weight.quantize(w, group), Int4Weight.quantize(w, group, importance=h)
    assert weighted_error(weighted, w, h) < 0.9 * weighted_error(plain, w, h)
    same = Int4Weight.quantize(w, group, importance=torch.full((384,), 3.0))  # uniform weights: the plain result
    assert weighted_error(same, w, torch.ones(384)) == pytest.approx(weighted_error(plain, w, torch.ones(384)),
                                                                     rel=1e-3)
    with pytest.raises(LocalpdError, match=r"one value per input column \(384\)"):
        Int4Weight.quantize(w, group, importance=h[:100])


def test_calibration_records_every_projection_input(default_gguf):
    loaded = load_model(default_gguf, scheme="native")
    model = Transformer(loaded.config, dict(loaded.weights))
    tokenizer = loaded.tokenizer()
    ids = tokenizer.encode(default_text())
    calib = calibrate(model, ids[:300])
    c = model.config
    assert calib.tokens == 300 and len(calib.importance) == 7 * c.n_layers
    assert all(isinstance(getattr(L, a), QuantLinear) for L in model.layers for a in ("qkv", "o", "gate_up", "down"))
    imp = calib.importance
    assert imp["layers.3.q_proj"] is imp["layers.3.v_proj"] and imp["layers.3.gate_proj"] is imp["layers.3.up_proj"]
    assert imp["layers.3.down_proj"].shape == (c.ffn_dim,) and imp["layers.3.o_proj"].shape == (c.dim,)
    assert all((t >= 0).all() and (t > 0).any() for t in imp.values())
    # independent count for layer 0's q/k/v input: RMSNorm of the embedding rows times the norm weight
    x = loaded.weights["embed_tokens"].dequantize()[ids[:300]]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * loaded.weights["layers.0.input_layernorm"]
    assert torch.allclose(imp["layers.0.q_proj"], h.pow(2).mean(0), rtol=1e-4, atol=1e-7)
    with pytest.raises(LocalpdError, match="fewer than 2 tokens"):
        calibrate_text(model, tokenizer, "")


@pytest.fixture(scope="module")
def int4_g64(default_gguf):
    """The default model requantized to int4-g64 at load time, without calibration: what both the calibrated file
    and the --no-calibration file are compared with (one requantization for the two tests)."""
    return load_model(default_gguf, scheme="int4-g64")


def test_calibrated_int4_is_closer_to_the_dense_model(default_gguf, engine, int4_g64, tmp_path, capsys):
    assert main(["quantize", str(default_gguf), "--scheme", "int4-g64", "--out", str(tmp_path / "q")]) == 0
    assert "calibrated on" in capsys.readouterr().err
    meta = json.loads((tmp_path / "q" / "localpd.json").read_text())
    assert meta["source"]["calibration"]["tokens"] > 1000 and len(meta["source"]["calibration"]["text_sha256"]) == 64
    calibrated = Engine(tmp_path / "q", device="cpu", max_context=1024)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in "".join(e.text for e in calibrated.chat(q, SamplingParams(temperature=0, max_tokens=16)))
    plain = int4_g64
    ids = engine.tokenizer.encode(Path("tests/data/apache-2.0.txt").read_text()[:3000])  # not the calibration text
    dense_ppl = perplexity(engine.model, ids, window=len(ids)).perplexity
    plain_ppl = perplexity(Transformer(plain.config, dict(plain.weights)), ids, window=len(ids)).perplexity
    calibrated_ppl = perplexity(calibrated.model, ids, window=len(ids)).perplexity
    calibrated.close()
    # measured (CPU, 2026-11-23): dense 15.67, plain 19.62 (x1.25), calibrated 16.89 (x1.08) on this window
    assert calibrated_ppl < dense_ppl * 1.15 and calibrated_ppl < plain_ppl * 0.9, (dense_ppl, plain_ppl,
                                                                                    calibrated_ppl)


def test_no_calibration_where_nothing_is_requantized(default_gguf, tmp_path, capsys):
    assert imports_every_matrix_exactly(default_gguf, "int4-g32")
    assert imports_every_matrix_exactly(default_gguf, "native")
    assert not imports_every_matrix_exactly(default_gguf, "int4-g64")
    assert not imports_every_matrix_exactly(default_gguf, "int8")  # Q4_1 matrices become int8: re-quantized
    assert main(["quantize", str(default_gguf), "--scheme", "int4-g32", "--out", str(tmp_path / "q")]) == 0
    assert "calibrated" not in capsys.readouterr().err  # the Q4_1 blocks are imported as they are
    assert json.loads((tmp_path / "q" / "localpd.json").read_text())["source"]["calibration"] is None


def test_no_calibration_flag_gives_the_load_time_weights(default_gguf, int4_g64, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(default_gguf), "--scheme", "int4-g64", "--out", str(out), "--no-calibration"]) == 0
    assert "calibrated" not in capsys.readouterr().err
    assert json.loads((out / "localpd.json").read_text())["source"]["calibration"] is None
    saved, fresh = load_model(out).weights, int4_g64.weights
    assert torch.equal(saved["layers.4.o_proj"].packed, fresh["layers.4.o_proj"].packed)
    assert torch.equal(saved["layers.4.o_proj"].scales, fresh["layers.4.o_proj"].scales)


def test_calibration_file_errors(default_gguf, tmp_path, capsys):
    args = ["quantize", str(default_gguf), "--scheme", "int4-g64", "--calibration", str(tmp_path / "none.txt")]
    assert main(args) == 1
    assert "cannot read calibration text" in capsys.readouterr().err
