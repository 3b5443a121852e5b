"""Small GGUF files of every tensor type llama.cpp writes load, under --quant native and fp32, and run.

(Their random weights make a chaotic network, so the two schemes' logits are not compared: the weights are.)"""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from localpd.load.loader import load_model
from localpd.quant.codebook import CodebookWeight, IQ4Weight, MXFP4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight

Q = gguf.GGMLQuantizationType
DIM, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 64
QUANTIZABLE = {"Q5_0", "Q5_1", "MXFP4", "TQ1_0", "TQ2_0"}  # gguf.quants makes these from floats
TYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS",
         "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"]
EXACT = {"Q5_0": Int5Weight, "Q5_1": Int5Weight, "Q5_K": Int5KWeight, "Q6_K": Int6KWeight, "Q3_K": Int3KWeight,
         "Q2_K": Int2KWeight,
         "IQ4_NL": IQ4Weight,
         "MXFP4": MXFP4Weight, "Q4_K": Int4KWeight}  # bit for bit on import
NEAR = {"IQ4_XS": (IQ4Weight, 1e-3)}  # within float16 rounding of scales (the others: int8 rounding)


def blocks_by_hand(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks whose values are finite and between 1e-3 and 100 at most in magnitude per block: random bytes,
    a block drawn again until it dequantizes so (the scale fields lie in different places for each type)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    out = np.empty((n, size), dtype=np.uint8)
    todo = np.arange(n)
    while todo.size:
        raw = rng.integers(0, 256, (todo.size, size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            peak = np.abs(ref_dequantize(raw, qtype)).max(axis=-1)
        ok = np.isfinite(peak) & (peak > 1e-3) & (peak < 100)
        out[todo[ok]] = raw[ok]
        todo = todo[~ok]
    return out.reshape(rows, cols // block * size)


def matrix(qtype, rows: int, cols: int, rng) -> np.ndarray:
    if qtype.name in QUANTIZABLE:
        return ref_quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    return blocks_by_hand(qtype, rows, cols, rng)


def write_model(path, type_name: str, seed: int = 0, others: dict | None = None):
    """A one-layer llama with every matrix in the type (embeddings and head in float32), but those that others
    ({"attn_v": "Q8_0"}) names in another."""
    rng = np.random.default_rng(seed)
    qtype = Q[type_name]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    kv = DIM // HEADS * KV_HEADS
    shapes = {"attn_q": (DIM, DIM), "attn_k": (kv, DIM), "attn_v": (kv, DIM), "attn_output": (DIM, DIM),
              "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM), "ffn_down": (DIM, FFN)}
    for name, (rows, cols) in shapes.items():
        t = Q[(others or {}).get(name, type_name)]
        w.add_tensor(f"blk.0.{name}.weight", matrix(t, rows, cols, rng), raw_dtype=t)
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(DIM, dtype=np.float32))
    for name in ("token_embd", "output"):
        w.add_tensor(f"{name}.weight", rng.standard_normal((VOCAB, DIM)).astype(np.float32) * 0.05)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def logits(lm, ids):
    from localpd.model.transformer import Batch, Transformer
    from localpd.kvcache.formats import new_kv_pool

    model = Transformer(lm.config, lm.weights)
    c = lm.config
    pool = new_kv_pool("fp32", c.n_layers, 2, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    with torch.no_grad():
        return model.forward(Batch.single(ids, 0, 2, 16, model.device, all_logits=True), pool)


def requantize(llama_quantize, source, path, file_type: str, *options: str) -> None:
    """llama.cpp's llama-quantize of source into path as file_type (--allow-requantize, 2 threads, and options)."""
    import subprocess

    made = subprocess.run([str(llama_quantize), "--allow-requantize", *options, str(source), str(path), file_type, "2"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]


def greedy_steps(config, weights, kv: str, prompt: int, decode: int) -> torch.Tensor:
    """The logits of a prompt (ids 100, 101, ...) and of `decode` greedy decode steps after it, [1 + decode, vocab]."""
    from localpd.kvcache.formats import new_kv_pool
    from localpd.model.transformer import Batch, Transformer

    model, c = Transformer(config, weights), config
    pool = new_kv_pool(kv, c.n_layers, 4, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    ids = list(range(100, 100 + prompt))
    with torch.no_grad():
        out = [model.forward(Batch.single(ids, 0, 4, 16, model.device), pool)[0]]
        for _ in range(decode):
            ids.append(int(out[-1].argmax()))
            out.append(model.forward(Batch.single(ids[-1:], len(ids) - 1, 4, 16, model.device), pool)[0])
    return torch.stack(out)


@pytest.mark.parametrize("type_name", TYPES)
def test_small_file_of_each_type_loads_and_runs(tmp_path, type_name):
    path = tmp_path / f"{type_name}.gguf"
    write_model(path, type_name)
    exact = load_model(path, scheme="fp32")
    native = load_model(path, scheme="native")
    for name, w in native.weights.items():
        if not name.endswith("_proj"):
            continue
        assert isinstance(w, (Int4Weight, Int8Weight, Int4KWeight, Int5Weight, Int5KWeight, Int6KWeight,
                              Int3KWeight, Int2KWeight, CodebookWeight)), name
        assert w.group == 32, name
        want, got = exact.weights[name], w.dequantize()
        if type_name in EXACT:
            assert isinstance(w, EXACT[type_name]) and torch.equal(got, want), name
        else:  # within float16 rounding of the scales, or int8's rounding of the file's values
            kind, tolerance = NEAR.get(type_name, (Int8Weight, 1e-2))
            assert isinstance(w, kind) and ((got - want).norm() / want.norm()).item() < tolerance, name
    assert torch.isfinite(logits(native, list(range(0, VOCAB, 5)))).all()


def test_q4_k_m_made_by_llama_cpp_loads_and_chats(tmp_path, default_gguf, llama_quantize):
    """The most common file on the hub: llama.cpp's Q4_K_M (Q4_K, Q6_K, Q5_0 and Q8_0 for this model's widths)."""
    import subprocess
    import sys

    from localpd.load.gguf import GGUFFile

    path = tmp_path / "q4_k_m.gguf"
    requantize(llama_quantize, default_gguf, path, "Q4_K_M")
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(GGUFFile(path).type_counts())
    chat = subprocess.run([sys.executable, "-m", "localpd.cli", "chat", str(path), "What is the capital of France?",
                           "--temperature", "0", "--max-tokens", "16", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr[-2000:]
    assert len(chat.stdout.split()) >= 3


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M"])
def test_k_quant_mixes_made_by_llama_cpp_decode_as_their_exact_values(tmp_path, default_gguf, llama_quantize,
                                                                       file_type):
    """llama.cpp's Q4_K_M and Q5_K_M of the default model (Q4_K or Q5_K, Q5_1, Q6_K and Q8_0 tensors), every one held
    as its file's blocks: a prompt and greedy decode steps on the CPU (decode's layers in one call) give the logits
    of the same model's weights dequantized to float32 (--quant fp32, the torch path) within the input's rounding
    (as the Q4_1 file does: 0.01), where Q6_K held as int8 moved them by up to 0.4."""
    path = tmp_path / f"{file_type}.gguf"
    requantize(llama_quantize, default_gguf, path, file_type)
    steps = []
    for scheme in ("native", "fp32"):
        lm = load_model(path, scheme=scheme)
        if scheme == "native":
            kinds = {type(w) for w in lm.weights.values()}
            assert {Int6KWeight, Int5Weight} <= kinds and (Int4KWeight in kinds or Int5KWeight in kinds)
        steps.append(greedy_steps(lm.config, lm.weights, "fp32", 10, 6))
    assert (steps[0] - steps[1]).abs().max().item() < 0.05


def test_q2_k_made_by_llama_cpp_decodes_as_its_exact_values(tmp_path, default_gguf, llama_quantize):
    """llama.cpp's Q2_K blocks in the default model's down projections (the only matrices whose width 256 divides:
    --tensor-type ffn_down=q2_k, where its Q2_K mix falls back to Q4_0 and Q3_K throughout), held as their codes in
    nibbles with each sub-block's scale and minimum (5.1 bits a weight, not int8's 8.5): a prompt and greedy decode
    steps on the CPU give the logits of the same weights dequantized to float32 (the torch path) within the
    input's rounding."""
    path = tmp_path / "q2_k.gguf"
    requantize(llama_quantize, default_gguf, path, "Q2_K", "--tensor-type", "ffn_down=q2_k")
    steps = []
    for scheme in ("native", "fp32"):
        lm = load_model(path, scheme=scheme)
        if scheme == "native":
            down = [w for name, w in lm.weights.items() if name.endswith("down_proj")]
            assert len(down) == lm.config.n_layers and all(isinstance(w, Int2KWeight) for w in down)
        steps.append(greedy_steps(lm.config, lm.weights, "fp32", 10, 6))
    assert (steps[0] - steps[1]).abs().max().item() < 0.05


def test_iq4_xs_made_by_llama_cpp_decodes_as_its_values_held_as_int8(tmp_path, default_gguf, llama_quantize):
    """llama.cpp's IQ4_XS file of the default model (IQ4_NL and IQ4_XS tensors, held at 4.5 bits a weight as 4-bit
    codes into their grid): a prompt and greedy decode steps give the same logits, bit for bit, as the same values
    held as int8 (8.5 bits, as they were before)."""
    from localpd.kernels.dispatch import as_int8

    path = tmp_path / "iq4_xs.gguf"
    requantize(llama_quantize, default_gguf, path, "IQ4_XS")
    lm = load_model(path, scheme="native")
    held = [w for w in lm.weights.values() if isinstance(w, CodebookWeight)]
    assert len(held) >= 180
    int8 = {k: as_int8(w) if isinstance(w, CodebookWeight) else w for k, w in lm.weights.items()}
    steps = [greedy_steps(lm.config, weights, "fp16", 20, 8) for weights in (lm.weights, int8)]
    assert torch.equal(steps[0], steps[1])


def test_a_layer_of_int4_beside_int8_decodes_on_the_cpu(tmp_path):
    """q and k in Q4_0 (int4) with v in Q8_0 (int8), as llama-quantize's mixes write them: the layer's projections
    cannot share one matrix (a StackedLinear), and the CPU's decode takes them op by op, prompt and decode steps
    alike, giving the prompt's logits again when it runs whole."""
    from localpd.model.transformer import Batch, Transformer
    from localpd.kvcache.formats import new_kv_pool

    path = tmp_path / "mixed.gguf"
    write_model(path, "Q4_0", others={"attn_v": "Q8_0"})
    lm = load_model(path, scheme="native")
    model, c = Transformer(lm.config, lm.weights), lm.config
    ids = [3, 17, 5, 9]
    whole = logits(lm, ids)[-1]
    pool = new_kv_pool("fp16", c.n_layers, 2, 16, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    with torch.no_grad():
        for i, t in enumerate(ids):
            last = model.forward(Batch.single([t], i, 2, 16, model.device), pool)[0]
    assert (last - whole).abs().max().item() < 1e-2
