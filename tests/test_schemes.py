"""Weight schemes on the real default model: exact native import, quantized answers, perplexity."""

import math

import pytest
import torch

from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.loader import load_model
from localpd.perplexity import perplexity
from localpd.quant.weights import Int4Weight, Int8Weight
from localpd.sampling import SamplingParams

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_native_import_keeps_gguf_blocks_and_dequantizes_to_the_dense_weights(default_gguf):
    native = load_model(default_gguf, scheme="native").weights
    dense = load_model(default_gguf, scheme="fp32").weights
    assert isinstance(native["layers.0.q_proj"], Int4Weight) and native["layers.0.q_proj"].group == 32
    assert isinstance(native["embed_tokens"], Int8Weight)  # Q8_0, tied: the output head too
    for name in ("layers.0.q_proj", "layers.7.k_proj", "layers.29.down_proj", "embed_tokens"):
        assert torch.equal(native[name].dequantize(torch.float32), dense[name]), name


@pytest.mark.parametrize("quant", ["native", "int8", "int4-g32", "int4-g64"])
def test_quantized_model_still_answers(default_gguf, quant):
    engine = Engine(default_gguf, device="cpu", quant=quant, max_context=256)
    text = "".join(e.text for e in engine.chat(Q, SamplingParams(temperature=0, max_tokens=16)))
    assert "Paris" in text


def test_unknown_and_unavailable_schemes(default_gguf):
    with pytest.raises(LocalpdError, match="unknown weight scheme"):
        load_model(default_gguf, scheme="int3")
    with pytest.raises(LocalpdError, match="bitsandbytes"):
        load_model(default_gguf, scheme="bnb-nf4")
    with pytest.raises(LocalpdError, match=r"int4-g128 needs the input dimension \(576\) to be a multiple of 128"):
        load_model(default_gguf, scheme="int4-g128")  # SmolLM2-135M's hidden size is 4.5 groups of 128


def test_perplexity_equals_transformers_loss_in_one_window(engine, hf_reference):
    hf_model, _ = hf_reference
    text = open("tests/data/apache-2.0.txt").read()[:3000]
    ids = engine.tokenizer.encode(text)
    with torch.no_grad():
        loss = hf_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    r = perplexity(engine.model, ids, window=len(ids))
    assert r.windows == 1 and r.tokens_scored == len(ids) - 1
    assert r.perplexity == pytest.approx(math.exp(loss), rel=1e-4)


def test_sliding_window_scores_every_token_once(engine):
    ids = engine.tokenizer.encode(open("tests/data/apache-2.0.txt").read()[:2500])
    full = perplexity(engine.model, ids, window=len(ids))
    slid = perplexity(engine.model, ids, window=128, stride=64)
    assert slid.tokens_scored == len(ids) - 1 and slid.windows > 3
    assert slid.perplexity > full.perplexity * 0.9  # less context: no better, and still sane
    assert slid.perplexity < full.perplexity * 1.5
