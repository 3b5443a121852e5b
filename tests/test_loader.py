"""Loading GGUF files and safetensors directories."""

import json

import numpy as np
import pytest
import torch

from localpd.errors import LocalpdError
from localpd.loader import load_model


@pytest.fixture(scope="module")
def loaded(default_gguf):
    return load_model(default_gguf, scheme="fp32")  # every matrix dequantized to float32


def test_gguf_config(loaded):
    c = loaded.config
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == ("llama", 30, 576, 9, 3, 64, 1536)
    assert c.tie_embeddings and "lm_head" not in loaded.weights
    assert c.vocab_size == 49152 and c.rope_theta == 100000.0
    assert loaded.weights["layers.0.k_proj"].shape == (192, 576)


def test_every_gguf_weight_equals_transformers_dequantized_weight(loaded, hf_reference):
    hf_model, _ = hf_reference
    ref = {k.removeprefix("model.").removesuffix(".weight").replace(".self_attn.", ".").replace(".mlp.", "."): v
           for k, v in hf_model.state_dict().items()}
    ref.pop("lm_head", None)  # tied
    assert set(ref) == set(loaded.weights)
    for name, w in loaded.weights.items():
        assert torch.equal(w, ref[name].float()), name  # includes the q/k row un-permutation


def tiny_hf_model(kind, tmp_path, shard=False):
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    if kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "10GB")
    return model


@pytest.mark.parametrize("kind,shard", [("llama", False), ("llama", True), ("qwen2", False)])
def test_safetensors_directory_matches_transformers_logits(kind, shard, tmp_path):
    from localpd.model import Batch, Transformer
    from localpd.quant.kv import new_kv_pool

    ref = tiny_hf_model(kind, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    lm = load_model(tmp_path)
    assert lm.config.qkv_bias == (kind == "qwen2")
    ids = torch.randint(0, 128, (17,))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    model = Transformer(lm.config, lm.weights)
    c = lm.config
    pool = new_kv_pool("fp32", c.n_layers, 2, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    got = model.forward(Batch.single(ids.tolist(), 0, 2, 16, model.device, all_logits=True), pool)
    assert (got - want).abs().max() < 1e-4


def test_missing_path(tmp_path):
    with pytest.raises(LocalpdError, match="not found"):
        load_model(tmp_path / "nope.gguf")


def test_truncated_and_junk_gguf(tmp_path, default_gguf):
    bad = tmp_path / "t.gguf"
    bad.write_bytes(default_gguf.read_bytes()[:3_000_000])
    with pytest.raises(LocalpdError, match="truncated|not a readable"):
        load_model(bad)
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(LocalpdError):
        load_model(bad)


def test_unsupported_architectures(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("x", np.ones(4, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(LocalpdError, match="unsupported architecture 'gpt2'"):
        load_model(path)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(LocalpdError, match="unsupported architecture 'gpt2'"):
        load_model(d)
