"""A model as localpd holds it -> a Hugging Face directory in compressed-tensors' pack-quantized format, which vLLM
and SGLang serve (int4/int8 weight-only): config.json with its quantization_config, model.safetensors, the
tokenizer files and generation_config.json. The compressed-tensors package packs every matrix.

pack-quantized stores value = (q - zero_point) * scale with integer codes and zero points. So int8 (symmetric, per
channel or per group) is exact, and so is int4 whose biases are -8 * scale (a Q4_0 file's: symmetric) or another
whole number of scales in -15..0 (asymmetric, zero point -8 - bias / scale): every group of the int4-zp-gN schemes
(quant/schemes.py; `localpd quantize --scheme int4-zp-g128` makes them from a float model), so those export exactly.
int4 with other float16 biases (Q4_1's, int4-gN's: 99.7% of the default model's groups) has no integer zero point that
holds them (integer_zeros finds the groups that have one, which are kept as they are); the others take one near
-8 - bias / scale and a refitted scale, its codes re-rounded to them (zero_point_fit), and int4-k's groups go the
same way; the added error is reported. (The package packs zero points as num_bits integers, so a float zero point
cannot be written; 8-bit codes would hold a group exactly only where bias / scale is a fraction j / k, k <= 17:
3.5% of the groups.)
Scales are written as float32, so the package decompresses exact weights to exactly localpd's values; the
embeddings and an untied output head are written dense (float32). bitsandbytes' formats are refused (source.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from localpd.errors import LocalpdError
from localpd.export.report import ExportReport
from localpd.export.source import Source, tokenizer_meta
from localpd.model.config import ModelConfig
from localpd.quant.int4k import Int4KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, Weight, integer_zeros
from localpd.text.tokenizer import Tokenizer

HF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3")}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
FLOAT_ZEROS = ("{n} int4 matrices have float zero points (a Q4_1 file's, an int4-gN scheme's), which "
               "compressed-tensors cannot hold: they are re-quantized to integer zero points, with the error above. "
               "For an exact int4 export, quantize the original float model to integer zero points (localpd quantize "
               "MODEL --scheme int4-zp-g128) and export that; --quant int8 exports 8-bit weights exactly")
TORCH_DTYPE = "float16"  # what vLLM runs it in by default (--dtype overrides); float16 holds Q4_x/Q8_0 scales exactly


def compressed_tensors():
    try:
        import compressed_tensors
    except ImportError:
        raise LocalpdError("--format compressed-tensors needs the compressed-tensors package: "
                           "pip install 'localpd[export]' (or compressed-tensors)") from None
    return compressed_tensors


def hf_name(key: str) -> str:
    """layers.3.q_proj -> model.layers.3.self_attn.q_proj, norm -> model.norm, lm_head -> lm_head."""
    if key == "lm_head":
        return key
    if key.startswith("layers."):
        _, i, part = key.split(".", 2)
        module = part.removesuffix(".bias")
        return f"model.layers.{i}.{'self_attn' if module in ATTN else 'mlp' if module.endswith('_proj') else ''}" \
               f".{part}".replace("..", ".")
    return f"model.{key}"


def int4_form(w: Weight) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """An int4 matrix's float32 scale and bias per group and its group, or None for other formats."""
    if isinstance(w, Int4KWeight):
        scale, bias = w.group_scales()
        return scale, bias, w.group
    if isinstance(w, Int4Weight):
        return w.scales.float(), w.biases.float(), w.group
    return None


def quantization(w: Weight) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(compressed-tensors' QuantizationArgs fields, the state the compressor takes: weight, weight_scale and an
    asymmetric weight's integer weight_zero_point) for a quantized matrix; None for a dense one."""
    if isinstance(w, Int8Weight):
        strategy = {"strategy": "channel"} if w.group == w.shape[1] else {"strategy": "group", "group_size": w.group}
        scale = w.scales.float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of zeros: any scale gives its codes
        return {"num_bits": 8, "symmetric": True, **strategy}, {"weight": w.dequantize(), "weight_scale": scale}
    form = int4_form(w)
    if form is None:
        return None
    scale, bias, group = form
    args = {"num_bits": 4, "strategy": "group", "group_size": group}
    zero, whole = integer_zeros(scale, bias)
    values = w.dequantize()
    if bool(whole.all()) and bool((zero == 8).all()):
        return {**args, "symmetric": True}, {"weight": values, "weight_scale": scale}
    if not bool(whole.all()):  # groups with float zero points refitted; the others kept as they are, exactly
        fitted_scale, fitted_zero = zero_point_fit(values, scale, bias, group)
        scale, zero = torch.where(whole, scale, fitted_scale), torch.where(whole, zero - 8, fitted_zero.float())
    else:
        zero = zero - 8
    return {**args, "symmetric": False}, {"weight": values, "weight_scale": scale,
                                          "weight_zero_point": zero.to(torch.int8)}


def zero_point_fit(values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, group: int,
                   rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 scale and an integer zero point z in -8..7 per group for values (q - z) * scale, q in -8..7, near
    the group's values = code * scale + bias: z within one of -8 - bias / scale, the scale refitted by least squares
    to the codes it rounds to (two rounds), the pair with the least squared error kept. On the default model's
    Q4_1 matrices: 12% less RMS error than the nearest zero point alone (docs/PERF.md)."""
    n, k = values.shape
    v = values.reshape(n, k // group, group)
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.where(scale > 0, scale, (bias.abs() / 7).clamp_min(tiny))[..., None]  # a constant group: any code
    nearest = torch.round(-bias[..., None] / scale) - 8
    best_err = best_scale = best_zero = None
    for shift in (0, -1, 1):
        z, s = (nearest + shift).clamp(-8, 7), scale
        for _ in range(rounds):
            c = torch.round(v / s + z).clamp(-8, 7) - z
            fitted = (c * v).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True).clamp_min(tiny)
            s = torch.where(fitted > 0, fitted, s)
        err = (((torch.round(v / s + z).clamp(-8, 7) - z) * s - v) ** 2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_scale, best_zero = err, s, z
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale, best_zero = torch.where(better, s, best_scale), torch.where(better, z, best_zero)
    return best_scale[..., 0], best_zero[..., 0].to(torch.int8)


def hf_config(config: ModelConfig, tokenizer: Tokenizer | None) -> dict:
    architecture, model_type = HF_ARCHS[config.arch]
    cfg = {"architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
           "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
           "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
           "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
           "rope_theta": config.rope_theta, "max_position_embeddings": config.max_context,
           "tie_word_embeddings": config.tie_embeddings, "torch_dtype": TORCH_DTYPE,
           "attention_bias": config.qkv_bias}
    if config.rope_scaling:
        if "low_freq_factor" not in config.rope_scaling:
            raise LocalpdError("this model's RoPE scaling came from a GGUF file's rope_freqs tensor, which a Hugging "
                               "Face config cannot state; export the original Hugging Face model")
        cfg["rope_scaling"] = {"rope_type": "llama3", **config.rope_scaling}
    if tokenizer is not None:
        cfg["bos_token_id"] = tokenizer.bos_id
        cfg["eos_token_id"] = tokenizer.tok.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    return cfg


def write_tokenizer(meta: dict, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json from a GGUF vocabulary (localpd's own
    reading of it, text.tokenizer), so transformers and vLLM tokenize as localpd does."""
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_gguf_metadata(meta)
    if tok.add_bos:
        tok.tok.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B",
                                                    special_tokens=[(tok.bos_token, tok.bos_id)])
    tok.tok.save(str(out / "tokenizer.json"))
    unk, pad = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "padding"))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token or None,
              "eos_token": tok.eos_token or None, "add_bos_token": tok.add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": tok.chat_template}
    if unk is not None:
        config["unk_token"] = tokens[unk]
    if pad is not None:
        config["pad_token"] = tokens[pad]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    eos = sorted(tok.eos_ids)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": eos}))


def export_compressed_tensors(source: Source, tmp: Path, report: ExportReport) -> None:
    """Write the model as a compressed-tensors directory at tmp; each matrix's loss goes to the report."""
    compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import save_file

    loaded, config = source.loaded, source.loaded.config
    if "rope_freqs" in loaded.weights:
        raise LocalpdError("this model's RoPE scaling is a GGUF rope_freqs tensor, which a Hugging Face config "
                           "cannot state; export the original Hugging Face model")
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, tuple[dict, list[str]]] = {}
    float_zeros = 0
    for key, w in loaded.weights.items():
        name = hf_name(key)
        q = quantization(w) if key not in ("embed_tokens", "lm_head") else None
        if q is None:  # dense: norms, biases, the embeddings and the output head (float32 where dequantized)
            dense = w if isinstance(w, torch.Tensor) else w.dequantize()
            tensors[name if key.endswith(".bias") else f"{name}.weight"] = dense.contiguous()
            report.add(name, f"dense {str(dense.dtype).removeprefix('torch.')}", dense.float(), dense.float())
            continue
        args, state = q
        scheme = QuantizationScheme(targets=[name], weights=QuantizationArgs(type="int", **args))
        packed = PackedQuantizationCompressor.compress(state, scheme)
        decoded = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
        kind = f"int{args['num_bits']} {args.get('group_size') or 'channel'} " \
               f"{'symmetric' if args['symmetric'] else 'asymmetric'}"
        report.add(name, kind, w.dequantize(), decoded.float())
        float_zeros += args["num_bits"] == 4 and not report.tensors[-1].exact
        tensors.update({f"{name}.{field}": t.contiguous() for field, t in packed.items()})
        groups.setdefault(json.dumps(args, sort_keys=True), (args, []))[1].append(name)
    if float_zeros:
        report.notes.append(FLOAT_ZEROS.format(n=float_zeros))
    quant = QuantizationConfig(
        config_groups={f"group_{i}": QuantizationScheme(targets=names, weights=QuantizationArgs(type="int", **args))
                       for i, (args, names) in enumerate(groups.values())},
        format="pack-quantized", quantization_status="compressed", ignore=["lm_head"])
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    meta = tokenizer_meta(loaded)
    tokenizer = loaded.tokenizer()
    cfg = hf_config(config, tokenizer)
    if groups:
        cfg["quantization_config"] = quant.to_dict()
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    if meta:
        write_tokenizer(meta, tmp)
    elif loaded.hf_dir is not None:
        for file in TOKENIZER_FILES:
            if (Path(loaded.hf_dir) / file).exists():
                shutil.copy(Path(loaded.hf_dir) / file, tmp / file)
