"""`localpd quantize`: save once, load without re-quantizing, same logits; damaged or mismatched files fail clearly."""

import importlib.util
import json
import sys

import pytest
import torch

from localpd.cli.main import main
from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.load.loader import load_model
from localpd.model.transformer import Batch, Transformer
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight
from localpd.kvcache.formats import new_kv_pool
from localpd.quant.weights import Int4Weight, Int8Weight
from localpd.quantize.quantize import quantize_model
from localpd.engine.sampling import SamplingParams

Q = [{"role": "user", "content": "What is the capital of France?"}]
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")


def logits(loaded, ids):
    model = Transformer(loaded.config, loaded.weights)
    c = model.config
    pool = new_kv_pool("fp32", c.n_layers, 4, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    return model.forward(Batch.single(ids, 0, 4, 16, model.device, all_logits=True), pool)


@pytest.mark.parametrize("scheme, kind", [("int4-g32", Int4Weight), ("int8", Int8Weight),
                                          pytest.param("bnb-nf4", Nf4Weight, marks=needs_bnb),
                                          pytest.param("bnb-int8", BnbInt8Weight, marks=needs_bnb)])
def test_saved_model_gives_the_same_logits_and_answers(default_gguf, tmp_path, monkeypatch, scheme, kind):
    out = quantize_model(str(default_gguf), scheme, tmp_path / scheme)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial directory left
    meta = json.loads((out / "localpd.json").read_text())
    assert meta["scheme"] == scheme and len(meta["source"]["sha256"]) == 64
    fresh = load_model(default_gguf, scheme=scheme)
    saved = load_model(out)
    assert isinstance(saved.weights["layers.0.q_proj"], kind)
    ids = list(range(100, 140))
    assert torch.equal(logits(fresh, ids), logits(saved, ids))  # bit-exact: the same stored integers
    engine = Engine(out, device="cpu", max_context=256)
    text = "".join(e.text for e in engine.chat(Q, SamplingParams(temperature=0, max_tokens=16)))
    assert "Paris" in text and engine.quant == "native"
    engine.close()
    with pytest.raises(LocalpdError, match="would need the original model"):
        load_model(out, scheme="int4-g128")
    if scheme.startswith("bnb-"):  # bitsandbytes' weights need it to run: said at once, not at the first matmul
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)
        with pytest.raises(LocalpdError, match=f"^{scheme} needs bitsandbytes: pip install bitsandbytes$"):
            load_model(out)


def test_cli_writes_into_the_cache_and_reports_it(default_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path))
    assert main(["quantize", str(default_gguf), "--scheme", "int8"]) == 0
    out = tmp_path / "quantized" / f"{default_gguf.stem}-int8"
    assert str(out) in capsys.readouterr().out and (out / "model.safetensors").exists()


def test_damaged_and_mismatched_files_fail_clearly(default_gguf, tmp_path):
    out = quantize_model(str(default_gguf), "int8", tmp_path / "q")
    tensors = out / "model.safetensors"
    whole = tensors.read_bytes()
    tensors.write_bytes(whole[: len(whole) // 2])  # truncated
    with pytest.raises(LocalpdError, match="damaged or truncated"):
        load_model(out)
    tensors.write_bytes(whole)
    meta = json.loads((out / "localpd.json").read_text())
    meta["config"]["dim"] = 640  # weights from another model than the config says
    (out / "localpd.json").write_text(json.dumps(meta))
    with pytest.raises(LocalpdError, match="do not belong together"):
        load_model(out)
    meta["version"] = 99
    (out / "localpd.json").write_text(json.dumps(meta))
    with pytest.raises(LocalpdError, match="unknown quantized format"):
        load_model(out)


def test_an_interrupted_save_leaves_nothing_behind(default_gguf, tmp_path, monkeypatch):
    import localpd.quant.store as store

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store, "save_file", boom)
    with pytest.raises(OSError):
        quantize_model(str(default_gguf), "int8", tmp_path / "q")
    assert list(tmp_path.iterdir()) == []
