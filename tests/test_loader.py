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
    elif kind == "qwen3":  # heads of 32: queries 128 wide against a hidden size of 64
        cfg, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    elif kind == "smollm3":  # four layers: the fourth takes no RoPE
        cfg = transformers.SmolLM3Config(**{**common, "num_hidden_layers": 4}, pad_token_id=None)
        cls = transformers.SmolLM3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # norm weights start at one: random ones, so that a norm applied wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "10GB")
    return model


@pytest.mark.parametrize("kind,shard", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False),
                                        ("smollm3", False)])
def test_safetensors_directory_matches_transformers_logits(kind, shard, tmp_path):
    ref = tiny_hf_model(kind, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    lm = load_model(tmp_path)
    assert lm.config.qkv_bias == (kind == "qwen2") and lm.config.qk_norm == (kind == "qwen3")
    assert lm.config.nope_layers == ([3] if kind == "smollm3" else [])
    assert_same_logits(lm, ref)


def assert_same_logits(lm, ref):
    """The loaded model's logits of every position of a random prompt are the transformers model's."""
    from localpd.model import Batch, Transformer
    from localpd.quant.kv import new_kv_pool

    ids = torch.randint(0, 128, (17,))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    model = Transformer(lm.config, lm.weights)
    c = lm.config
    pool = new_kv_pool("fp32", c.n_layers, 2, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    got = model.forward(Batch.single(ids.tolist(), 0, 2, 16, model.device, all_logits=True), pool)
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "smollm3"])
def test_gguf_written_as_llama_cpp_does_matches_transformers_logits(kind, tmp_path):
    """A GGUF as llama.cpp's converter writes it loads as the same model. Qwen3: attn_q_norm/attn_k_norm,
    key_length for the head size, q/k rows as they are. SmolLM3: q/k rows permuted for interleaved RoPE (as for
    llama), and no RoPE in every fourth layer, which no metadata key says."""
    import gguf

    ref = tiny_hf_model(kind, tmp_path)
    c = ref.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    path = tmp_path / f"{kind}.gguf"
    w = gguf.GGUFWriter(path, kind)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    heads = {"self_attn.q_proj": c.num_attention_heads, "self_attn.k_proj": c.num_key_value_heads}
    for key, t in ref.state_dict().items():
        key = key.removesuffix(".weight")
        if key == "lm_head" and c.tie_word_embeddings:
            continue
        if key.startswith("model.layers."):
            _, _, i, part = key.split(".", 3)
            name = f"blk.{i}.{names[part]}"
            if kind == "smollm3" and part in heads:  # each head's rows in pairs (i, i + half), as llama.cpp permutes
                t = t.reshape(heads[part], 2, t.shape[0] // heads[part] // 2, -1).transpose(1, 2).reshape(t.shape)
        else:
            name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[key]
        w.add_tensor(name + ".weight", t.float().numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    lm = load_model(path, scheme="fp32")
    c = lm.config
    assert (c.arch, c.qk_norm, c.head_dim, c.nope_layers) == (
        ("qwen3", True, 32, []) if kind == "qwen3" else ("llama", False, 16, [3]))
    assert_same_logits(lm, ref)


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
