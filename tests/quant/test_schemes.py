"""Weight schemes on the real default model: exact native import, quantized answers, perplexity."""

import math
import sys
from pathlib import Path

import pytest
import torch

from localpd.cli.main import main
from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.load.loader import load_model
from localpd.model.transformer import Batch
from localpd.measure.perplexity import perplexity
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight
from localpd.kvcache.formats import new_kv_pool
from localpd.quant.weights import Int4Weight, Int8Weight, integer_zeros
from localpd.engine.sampling import SamplingParams
from localpd.quant.schemes import imports_exactly, int4_group, quantize

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_native_import_keeps_gguf_blocks_and_dequantizes_to_the_dense_weights(default_gguf):
    native = load_model(default_gguf, scheme="native").weights
    dense = load_model(default_gguf, scheme="fp32").weights
    assert isinstance(native["layers.0.q_proj"], Int4Weight) and native["layers.0.q_proj"].group == 32
    assert isinstance(native["embed_tokens"], Int8Weight)  # Q8_0, tied: the output head too
    for name in ("layers.0.q_proj", "layers.7.k_proj", "layers.29.down_proj", "embed_tokens"):
        assert torch.equal(native[name].dequantize(torch.float32), dense[name]), name


@pytest.fixture(scope="module")
def quantized(default_gguf):
    """quantized(scheme): the default model's engine in a weight scheme, built once for this file's tests
    (requantizing the Q4_1 file to int4-g64 or int4-g128 takes most of a minute on CI's 2 cores)."""
    engines = {}

    def get(quant: str) -> Engine:
        if quant not in engines:
            engines[quant] = Engine(default_gguf, device="cpu", quant=quant, max_context=256)
        return engines[quant]

    yield get
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("quant", ["native", "int8", "int4-g32", "int4-g64", "int4-g128"])
def test_quantized_model_still_answers(quantized, quant):
    engine = quantized(quant)
    text = "".join(e.text for e in engine.chat(Q, SamplingParams(temperature=0, max_tokens=16)))
    assert "Paris" in text


def test_int4_g128_falls_back_to_g64_where_128_does_not_divide_the_input(quantized):
    # SmolLM2-135M: hidden size 576 = 4.5 x 128 (q/k/v/o/gate/up inputs), ffn size 1536 = 12 x 128 (down_proj)
    engine = quantized("int4-g128")
    layer = engine.model.layers[5]
    assert layer.down.weight.group == 128
    assert layer.qkv.weight.group == layer.o.weight.group == layer.gate_up.weight.group == 64
    assert engine.notes == ["int4-g128: gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj use groups of 64 "
                            "(input dimension not a multiple of 128)"]
    assert quantized("int4-g64").notes == []


def test_int4_group_fallback_rules():
    assert [int4_group("int4-g128", k) for k in (4096, 576, 1536, 96, 160)] == [128, 64, 128, 32, 32]
    assert int4_group("int4-g32", 4096) == 32  # never a coarser group than asked for
    with pytest.raises(LocalpdError, match=r"int4-g64 needs the input dimension \(100\) to be a multiple of 32"):
        int4_group("int4-g64", 100)


def test_int4_zp_schemes_keep_integer_zero_points_in_int4s_groups():
    """int4-zp-gN: Int4Weight in int4-gN's groups (the same fallback), every bias a whole number of scales; a Q4_0
    file's blocks ((q - 8) * d) are such groups already, so they import as they are."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(2)) * 0.02
    zp, plain = quantize(w, "int4-zp-g128", torch.float32), quantize(w, "int4-g128", torch.float32)
    assert isinstance(zp, Int4Weight) and zp.group == plain.group == int4_group("int4-zp-g128", 576) == 64
    assert bool(integer_zeros(zp.scales.float(), zp.biases.float())[1].all())
    assert not bool(integer_zeros(plain.scales.float(), plain.biases.float())[1].all())
    assert imports_exactly("Q4_0", "int4-zp-g32") and not imports_exactly("Q4_1", "int4-zp-g32")
    assert not imports_exactly("Q4_0", "int4-zp-g64")


def last_logits(model, ids):
    c = model.config
    pool = new_kv_pool("fp32", c.n_layers, 8, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    return model.forward(Batch.single(ids, 0, 8, 16, model.device), pool)[0]


# Measured on SmolLM2-135M Q4_1 against the fp32 model (the `engine` fixture), CPU: relative error of the chat
# prompt's last-position logits, and perplexity over the apache-2.0.txt window below as a ratio to fp32's (18.03).
#   int8:     0.074, ppl x0.995    int4-g64 (re-quantized, clipping search): 0.142, ppl x1.25
#   bnb-int8: 0.102, ppl x1.002    (LLM.int8's 8-bit activations; the int8 head keeps greedy answers)
#             0.301 since the CPU attention became localpd's kernel, which moves the fp32 model's logits by 1e-6
#             (0.098 and 0.118 with torch's attention or RoPE alone): LLM.int8's outlier threshold (6.0) makes its
#             error jump with inputs that far apart, so its bound is set over that spread
#   bnb-nf4:  0.177, ppl x1.42     (plain absmax NF4 re-quantizes the 4-bit Q4_1 weights: a second rounding)
# Bounds: about 1.5x the measured logit error, the perplexity ratio with a few percent to spare.
@pytest.mark.parametrize("quant, kind, max_err, max_ppl", [("bnb-int8", BnbInt8Weight, 0.4, 1.05),
                                                           ("bnb-nf4", Nf4Weight, 0.27, 1.5)])
def test_bitsandbytes_schemes_answer_and_stay_near_the_dense_model(default_gguf, engine, quant, kind, max_err,
                                                                   max_ppl):
    pytest.importorskip("bitsandbytes")
    bnb = Engine(default_gguf, device="cpu", quant=quant, max_context=512)
    layer = bnb.model.layers[3]
    assert isinstance(layer.qkv.weight, kind) and isinstance(layer.down.weight, kind)  # q/k/v: one fused matrix
    assert isinstance(bnb.model.lm_head.weight, Int8Weight)  # the (tied) head stays at int8
    text = "".join(e.text for e in bnb.chat(Q, SamplingParams(temperature=0, max_tokens=16)))
    assert "Paris" in text
    ids = bnb.encode_chat(Q)
    got, ref = last_logits(bnb.model, ids), last_logits(engine.model, ids)
    assert got.argmax() == ref.argmax() and ((got - ref).norm() / ref.norm()).item() < max_err
    ids = engine.tokenizer.encode(Path("tests/data/apache-2.0.txt").read_text()[:1500])
    dense_ppl = perplexity(engine.model, ids, window=len(ids)).perplexity
    assert perplexity(bnb.model, ids, window=len(ids)).perplexity < dense_ppl * max_ppl
    bnb.close()


def test_unknown_and_unavailable_schemes(default_gguf, monkeypatch, capsys):
    with pytest.raises(LocalpdError, match="unknown weight scheme"):
        load_model(default_gguf, scheme="int3")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    for scheme in ("bnb-nf4", "bnb-int8"):
        with pytest.raises(LocalpdError) as e:
            load_model(default_gguf, scheme=scheme)
        assert str(e.value) == f"{scheme} needs bitsandbytes: pip install bitsandbytes"
    assert main(["quantize", str(default_gguf), "--scheme", "bnb-nf4"]) == 1  # before touching the model
    assert capsys.readouterr().err == "localpd: error: bnb-nf4 needs bitsandbytes: pip install bitsandbytes\n"


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
