"""The fused elementwise kernels (residual add + RMSNorm, SiLU * mul, RoPE, Qwen3's q/k norm) against their torch
references, and a whole (tiny, random) model run with every Triton kernel against the same model on the
references: on the CPU through Triton's interpreter, or compiled on a GPU with LOCALPD_TEST_DEVICE=cuda."""

import math
import os
from dataclasses import fields, replace

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.model.config import ModelConfig  # noqa: E402
from localpd.kernels.fused_dispatch import (add_rms_norm, add_rms_norm_ref, qk_norm, qk_norm_ref,  # noqa: E402
                                            rope, rope_ref, act_mul, act_mul_ref)
from localpd.model.transformer import Batch, Transformer  # noqa: E402
from localpd.kvcache.formats import new_kv_pool  # noqa: E402
from localpd.load.synthetic import random_weight  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# a float32 model against its torch references: on a GPU the attention's dots run in tf32 (H200, 2026-11-26: up to
# 2.9e-4 over a prefill and two decode steps of the tiny model)
FP32_MODEL_TOL = 1e-4 if DEV == "cpu" else 1e-3


@pytest.fixture
def triton_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + 0.3).to(dtype).to(DEV)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 576), (3, 1000), (5, 64), (2, 4096)])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm(triton_on, dtype, T, N, residual):
    x, r, w = rand(T, N, dtype=dtype, seed=1), rand(T, N, dtype=dtype, seed=2), rand(N, dtype=dtype, seed=3)
    r = r if residual else None
    h, s = add_rms_norm(x, r, w, 1e-5)
    h_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-5)
    assert h.dtype == s.dtype == dtype and h.shape == s.shape == (T, N)
    if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter rounds to bf16 toward zero, torch to nearest
        assert (s.float() - s_ref.float()).abs().max() <= s_ref.float().abs().max() * 2**-7
    else:  # the residual stream is the same rounded sum on both paths
        assert torch.equal(s, s_ref)
    assert rel_err(h, h_ref) < TOL[dtype]


def test_add_rms_norm_strided_rows(triton_on):
    """Rows gathered for the logits and a residual that is a strided view still work."""
    x = rand(6, 130, dtype=torch.float32, seed=4)[::2]
    r = rand(3, 260, dtype=torch.float32, seed=5)[:, :130]
    w = rand(130, dtype=torch.float32, seed=6)
    h, s = add_rms_norm(x, r, w, 1e-6)
    h_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(s, s_ref) and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (4, 100), (2, 3000)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul(triton_on, dtype, T, I, act):
    gu = rand(T, 2 * I, dtype=dtype, seed=7) * 4  # into GELU's tails, where its tanh form must not cancel
    out = act_mul(gu, act)
    assert out.shape == (T, I) and out.dtype == dtype
    assert rel_err(out, act_mul_ref(gu, act)) < TOL[dtype]
    if act == "gelu_tanh":  # the reference is Gemma's: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        g, u = gu.float().chunk(2, dim=-1)
        by_hand = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
        assert rel_err(act_mul_ref(gu, act).float(), by_hand) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 96, 128])
def test_rope_in_place_on_a_qkv_view(triton_on, dtype, D):
    T, Hq, Hkv = 3, 5, 2
    qkv = rand(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=8)
    angles = torch.outer(torch.tensor([0.0, 7.0, 4093.0]), 1.0 / 10000 ** (torch.arange(0, D, 2) / D)).to(DEV)
    cos, sin = angles.cos(), angles.sin()
    expect = rope_ref(qkv.clone()[:, :(Hq + Hkv) * D].view(T, -1, D), cos, sin)
    v_before = qkv[:, (Hq + Hkv) * D:].clone()
    out = rope(qkv[:, :(Hq + Hkv) * D].view(T, -1, D), cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    assert rel_err(qkv[:, :(Hq + Hkv) * D].view(T, -1, D), expect) < TOL[dtype]
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before)  # the value heads are not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 16, 8, 128), (3, 5, 1, 64), (2, 7, 3, 96), (2, 4, 1, 256)])
def test_qk_norm_in_place(triton_on, dtype, T, Hq, Hkv, D):
    """Each query and key head normalised over head_dim with its own weight, in place; values untouched."""
    qkv = rand(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=10)
    wq, wk = rand(D, dtype=dtype, seed=11), rand(D, dtype=dtype, seed=12)
    before = qkv.double()
    expect = qk_norm_ref(qkv.clone(), wq, wk, Hq, Hkv, 1e-6)
    assert qk_norm(qkv, wq, wk, Hq, Hkv, 1e-6).data_ptr() == qkv.data_ptr()
    assert rel_err(qkv, expect) < TOL[dtype]
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], expect[:, (Hq + Hkv) * D:])
    assert torch.equal(qkv[:, (Hq + Hkv) * D:].double(), before[:, (Hq + Hkv) * D:])  # the values untouched
    # the reference itself, against the formula: the last query head and the last key head
    for head, w in ((Hq - 1, wq), (Hq + Hkv - 1, wk)):
        x = before[:, head * D:(head + 1) * D]
        want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
        assert rel_err(expect[:, head * D:(head + 1) * D], want) < TOL[dtype]


def tiny_model(scheme: str, dtype: torch.dtype, device: str, qk_norm: bool = False,
               gemma: bool = False, padded: bool = False, head: int = 64) -> Transformer:
    """Two layers, GQA, head_dim 64 (the KV kernels' size), an odd MLP width; random norms and biases; qk_norm:
    Qwen3's per-head norms of queries and keys too; gemma: Gemma 3's layout, the first layer's attention a sliding
    window of 5 with its own RoPE base, norms around each sublayer, GELU, scaled embeddings and q.k; padded: heads
    of 48 from the projections, taken in heads of 64 (loader.pad_heads, as a head of 80 in 96); head: the head
    size otherwise (96: Phi-3-mini's, which the kernels take as it is)."""
    c = ModelConfig("llama", 300, 128, 2, 4, 2, head, 160, 1e-5, 10000.0, max_context=256, qkv_bias=True,
                    qk_norm=qk_norm or gemma, proj_head_dim=48 if padded else 0, rotary_dim=48 if padded else 0)
    p = 48 if padded else head
    if gemma:
        c = replace(c, arch="gemma3", rope_theta=1e6, sliding_window=5, swa_layers=[0], rope_local_theta=1e4,
                    embed_scale=128 ** 0.5, sandwich_norms=True, act="gelu_tanh", attn_scale=24 ** -0.5)
    g = torch.Generator().manual_seed(9)
    shapes = {"q_proj": (4 * p, 128), "k_proj": (2 * p, 128), "v_proj": (2 * p, 128), "o_proj": (128, 4 * p),
              "gate_proj": (160, 128), "up_proj": (160, 128), "down_proj": (128, 160)}
    w = {"embed_tokens": torch.randn(300, 128, generator=g).to(dtype), "norm": (1 + 0.1 * torch.randn(128, generator=g)).to(dtype),
         "lm_head": random_weight((300, 128), "int8", dtype, "cpu", g)}
    for i in range(2):
        for name, shape in shapes.items():
            w[f"layers.{i}.{name}"] = random_weight(shape, scheme, dtype, "cpu", g)
        for proj, n in (("q", 4 * p), ("k", 2 * p), ("v", 2 * p)):
            w[f"layers.{i}.{proj}_proj.bias"] = (0.1 * torch.randn(n, generator=g)).to(dtype)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"layers.{i}.{norm}"] = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
        if qk_norm or gemma:
            for norm in ("q_norm", "k_norm"):
                w[f"layers.{i}.{norm}"] = (1 + 0.1 * torch.randn(head, generator=g)).to(dtype)
        for norm in ("attn_out_norm", "mlp_out_norm") if gemma else ():
            w[f"layers.{i}.{norm}"] = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
    return Transformer(c, {k: move(v, device) for k, v in w.items()})


def move(w, device):
    if isinstance(w, torch.Tensor):
        return w.to(device)
    return replace(w, **{f.name: getattr(w, f.name).to(device) for f in fields(w)})


def prompt_then_decode(model: Transformer, kv_dtype: str) -> list[torch.Tensor]:
    c, ps, dev = model.config, 16, model.device
    prompt, decode = [int(t) for t in torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(1))], [5, 299]
    n_pages = 3
    pool = new_kv_pool(kv_dtype, c.n_layers, n_pages, ps, c.n_kv_heads, c.head_dim, model.dtype, dev)
    out = [model.forward(Batch.single(prompt, 0, n_pages, ps, dev), pool)]
    for i, t in enumerate(decode):
        out.append(model.forward(Batch.single([t], len(prompt) + i, n_pages, ps, dev), pool))
    return [o.float().cpu() for o in out]


@pytest.mark.parametrize("scheme,kv_dtype,qk", [("int4-g32", "int8", False), ("fp32", "fp32", False),
                                                ("int8", "int4ch/int4", False), ("int4-g32", "int8/int4", True),
                                                ("int4-g32", "int8", "gemma"), ("int4-g32", "int4", "padded"),
                                                ("int4-g32", "int4ch/int4", "head96"), ("int8", "int8", "head96")])
def test_whole_model_on_triton_kernels_matches_the_references(monkeypatch, scheme, kv_dtype, qk):
    """Prefill then two decode steps with every kernel in Triton (matmuls, KV writes, attention, fused norms,
    RoPE, SiLU, Qwen3's q/k norm; Gemma 3's sliding-window attention; heads of 48 in heads of 64; heads of 96 as
    they are) against the same model on the torch references."""
    from localpd.kernels import cpu

    monkeypatch.delenv("LOCALPD_TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cpu, "library", lambda: None)  # the torch references, not localpd's CPU kernels
    qk, gemma, padded, head = qk is True, qk == "gemma", qk == "padded", 96 if qk == "head96" else 64
    ref = prompt_then_decode(tiny_model(scheme, torch.float32, "cpu", qk, gemma, padded, head), kv_dtype)
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")
    out = prompt_then_decode(tiny_model(scheme, torch.float32, DEV, qk, gemma, padded, head), kv_dtype)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert rel_err(o, r) < FP32_MODEL_TOL


@pytest.mark.parametrize("scheme,tied", [("int4-g32", False), ("int8", True)])
def test_whole_model_in_the_gpu_layout_matches_the_references(monkeypatch, scheme, tied):
    """The model's int4/int8 matrices in the K-major layout (what a GPU runs: Transformer._to_gpu_layout, done
    here by hand under the interpreter), prefill and decode on kernels/gemv_kmajor.py, against the row-major
    model on the torch references; a tied output head keeps one K-major copy that the embedding lookup reads."""
    from localpd.kernels import cpu
    from localpd.quant.kmajor import KMajorWeight

    monkeypatch.delenv("LOCALPD_TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cpu, "library", lambda: None)
    ref_model = tiny_model(scheme, torch.float32, "cpu")
    if tied:  # the embedding lookup reads the output head's (int8) matrix
        ref_model.embed = ref_model.lm_head.weight
    ref = prompt_then_decode(ref_model, "int8")
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")
    model = tiny_model(scheme, torch.float32, DEV)  # on a GPU converted as it is built (untied)
    if tied:
        model.embed = model.lm_head.weight
    if DEV == "cpu":
        model._to_gpu_layout()
    linears = [model.layers[0].qkv, model.layers[1].down, model.lm_head]
    assert all(isinstance(lin.weight, KMajorWeight) for lin in linears)
    assert model.embed is model.lm_head.weight or not tied
    out = prompt_then_decode(model, "int8")
    for o, r in zip(out, ref):
        assert rel_err(o, r) < FP32_MODEL_TOL


def count_decode_launches(monkeypatch, fused: bool, gpu_layout: bool = False,
                          dtype: torch.dtype = torch.float32) -> tuple[list[str], torch.Tensor]:
    """The Triton kernels one decode step of the tiny model launches in the interpreter, and its logits."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")
    model, ps = tiny_model("int4-g32", dtype, "cpu"), 16
    model.fused = fused
    if gpu_layout:
        model._to_gpu_layout()
    c = model.config
    pool = new_kv_pool("int8", c.n_layers, 2, ps, c.n_kv_heads, c.head_dim, model.dtype, "cpu")
    model.forward(Batch.single(list(range(1, 20)), 0, 2, ps, "cpu"), pool)
    launched, run = [], InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    logits = model.forward(Batch.single([7], 19, 2, ps, "cpu"), pool)
    monkeypatch.undo()
    return launched, logits


@pytest.mark.skipif(DEV != "cpu", reason="counts the Triton interpreter's launches")
def test_a_decode_step_launches_seven_kernels_per_layer(monkeypatch):
    """The fusions hold: per layer one GEMV each for qkv, o, gate_up and down (the residual add and RMSNorm inside
    qkv's and gate_up's, SiLU * mul inside down's), one kernel for RoPE and the KV write, and the decode attention
    and its reduce; the final norm runs inside the output head's GEMV. Unfused (Transformer.fused = False, for
    measuring the fusions) the same step launches the twelve kernels a layer it did before them, with the same
    logits."""
    launched, logits = count_decode_launches(monkeypatch, fused=True)
    layer = ["_gemv_kernel", "rope_write_kv_kernel", "decode_kernel", "decode_reduce_kernel", "_gemv_kernel",
             "_gemv_kernel", "_gemv_kernel"]
    assert launched == layer * 2 + ["_gemv_kernel"]
    launched, unfused_logits = count_decode_launches(monkeypatch, fused=False)
    layer = ["add_rms_norm_kernel", "_gemv_kernel", "rope_kernel", "write_kv_kernel", "write_kv_kernel",
             "decode_kernel", "decode_reduce_kernel", "_gemv_kernel", "add_rms_norm_kernel", "_gemv_kernel",
             "act_mul_kernel", "_gemv_kernel"]
    assert launched == layer * 2 + ["add_rms_norm_kernel", "_gemv_kernel"]
    assert rel_err(unfused_logits, logits) < 1e-5
    # in the GPU's K-major layout the norms and SiLU * up run apart (gemv_kmajor.FUSE_INPUT_STEP), ten a layer,
    # split-K reduced inside each GEMV's own launch
    launched, km_logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True)
    layer = ["add_rms_norm_kernel", "_gemv_kmajor_kernel", "rope_write_kv_kernel", "decode_kernel",
             "decode_reduce_kernel", "_gemv_kmajor_kernel", "add_rms_norm_kernel", "_gemv_kmajor_kernel",
             "act_mul_kernel", "_gemv_kmajor_kernel"]
    assert launched == layer * 2 + ["add_rms_norm_kernel", "_gemv_kmajor_kernel"]
    assert rel_err(km_logits, logits) < 1e-5


@pytest.mark.skipif(DEV != "cpu", reason="counts the Triton interpreter's launches")
def test_a_bfloat16_decode_step_rounds_each_gemv_input_where_it_is_made(monkeypatch):
    """With 16-bit activations the K-major GEMVs are the integer ones (kernels/gemv_dp4a.py): the RMSNorms, the
    decode attention's reduce (o's input) and SiLU * up round their outputs for them as they write them: ten
    launches a layer; the logits bit for bit those of o's input rounded in a launch of its own, and those of the
    float GEMVs within bfloat16's rounding."""
    from localpd.kernels import gemv_dp4a

    launched, logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True, dtype=torch.bfloat16)
    layer = ["add_rms_norm_kernel", "_gemv_dp4a_kernel", "rope_write_kv_kernel", "decode_kernel",
             "decode_reduce_kernel", "_gemv_dp4a_kernel", "add_rms_norm_kernel", "_gemv_dp4a_kernel",
             "act_mul_kernel", "_gemv_dp4a_kernel"]
    assert launched == layer * 2 + ["add_rms_norm_kernel", "_gemv_dp4a_kernel"]
    monkeypatch.setattr(Transformer, "_o_input", lambda *a: None)  # o's input rounded by quantize_act
    launched, apart_logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True, dtype=torch.bfloat16)
    assert launched.count("_quantize_act_kernel") == 2 and torch.equal(apart_logits, logits)
    monkeypatch.setattr(gemv_dp4a, "ENABLED", False)
    launched, float_logits = count_decode_launches(monkeypatch, fused=True, gpu_layout=True, dtype=torch.bfloat16)
    assert "_gemv_dp4a_kernel" not in launched
    assert rel_err(logits, float_logits) < 2e-2
