"""A model file or directory -> ModelConfig + dense weights under HF-style names. No pickle anywhere."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from localpd.model.config import ModelConfig, matrix_shapes
from localpd import heap
from localpd.errors import LocalpdError
from localpd.load.gguf import GGUFFile
from localpd.load import gguf_import
from localpd.load.placement import Placement
from localpd.kvcache.dispatch import kernel_head_dim
from localpd.quant.store import is_quantized_dir, load_quantized, tokenizer_meta
from localpd.quant.weights import Weight, from_gguf, weight_nbytes
from localpd.quant.schemes import (check_scheme, from_blocks, head_scheme, imports_codes, imports_exactly, is_matrix,
                                   native_weight, quantize)
from localpd.text.tokenizer import Tokenizer

GGUF_NAMES = {  # GGUF tensor name (after blk.N.) -> HF-style name (after layers.N.)
    "attn_norm": "input_layernorm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
    "attn_output": "o_proj", "ffn_norm": "post_attention_layernorm", "ffn_gate": "gate_proj",
    "ffn_up": "up_proj", "ffn_down": "down_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "attn_qkv": "qkv_proj", "post_attention_norm": "attn_out_norm", "post_ffw_norm": "mlp_out_norm",
}
GGUF_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head", "rope_freqs": "rope_freqs"}
ARCHS = {"llama": "llama", "mistral": "llama", "smollm3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
         "gemma3": "gemma3", "gemma3_text": "gemma3"}
GEMMA3_GLOBAL_STEP = 6  # every 6th Gemma 3 layer attends to everything, the rest to a sliding window
# Gemma's HF norm names -> the model's (its pre-MLP norm is the llama family's post_attention_layernorm)
GEMMA_NORMS = {"post_attention_layernorm": "attn_out_norm", "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "mlp_out_norm"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # Phi-3's matrices
NOPE_STEP = {"smollm3": 4}  # GGUF architectures whose every Nth layer takes no RoPE (llama.cpp's fixed step)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: Path
    gguf: GGUFFile | None = None
    hf_dir: Path | None = None  # where tokenizer.json lies
    tokenizer_meta: dict | None = None  # GGUF tokenizer metadata kept by `localpd quantize`

    def tokenizer(self) -> Tokenizer | None:
        """The model's own tokenizer: from the GGUF metadata, the kept metadata or tokenizer.json (None if none)."""
        if self.gguf is not None:
            return Tokenizer.from_gguf_metadata(self.gguf.metadata)
        if self.tokenizer_meta is not None:
            return Tokenizer.from_gguf_metadata(self.tokenizer_meta)
        return Tokenizer.from_dir(self.hf_dir) if self.hf_dir is not None else None


def load_model(path, dtype: torch.dtype = torch.float32, device="cpu", scheme: str = "native",
               importance: dict[str, torch.Tensor] | None = None) -> LoadedModel:
    """Load tensor by tensor, each moved to the device and converted to the scheme at once, so peak memory
    stays near the converted size. Norms and the (untied) embeddings stay dense in dtype. importance: per weight
    name, its input columns' activation importance (localpd.quantize.calibrate) for the schemes that re-quantize."""
    path = Path(path)
    check_scheme(scheme)
    if not path.exists():
        raise LocalpdError(f"model file not found: {path}")
    if path.is_dir():
        if is_quantized_dir(path):
            return load_quantized_dir(path, dtype, device, scheme)
        return load_hf_dir(path, dtype, device, scheme, importance)
    return load_gguf(path, dtype, device, scheme, importance)


def load_quantized_dir(path: Path, dtype, device, scheme: str) -> LoadedModel:
    """What `localpd quantize` wrote: weights as stored, dense ones (norms) in the compute dtype."""
    fields_of_config, weights, _ = load_quantized(path, device, scheme)
    config = ModelConfig(**fields_of_config)
    for name, w in weights.items():
        if isinstance(w, torch.Tensor) and name != "rope_freqs":
            weights[name] = w.to(dtype)
    for name, shape in matrix_shapes(config).items():
        if name not in weights or tuple(weights[name].shape) != shape:
            got = tuple(weights[name].shape) if name in weights else "nothing"
            raise LocalpdError(f"{path}: weight {name} is {got}, the model's config says {shape}: the files do "
                               f"not belong together; quantize the model again")
    meta = tokenizer_meta(path)
    return LoadedModel(config, weights, path, hf_dir=None if meta else path, tokenizer_meta=meta)


def rows(w: Weight, index) -> Weight:
    """Output rows `index` (a slice or index tensor) of a matrix or bias in any format: every quantized format is a
    dataclass of tensors indexed by output row."""
    if isinstance(w, torch.Tensor):
        return w[index if isinstance(index, slice) else index.to(w.device)]
    return replace(w, **{f.name: rows(getattr(w, f.name), index) for f in fields(w)})


def qk_order(n: int, n_heads: int) -> torch.Tensor:
    """The GGUF row that each of HF's q/k rows comes from: llama.cpp stores a head's rotated pairs interleaved
    (rows 2i, 2i + 1), HF half-rotated (rows i, i + head_dim / 2)."""
    return torch.arange(n).reshape(n_heads, n // n_heads // 2, 2).transpose(1, 2).reshape(-1)


def unpermute_qk(w: Weight, n_heads: int) -> Weight:
    """Undo llama.cpp's row permutation of q/k (interleaved RoPE pairs) back to HF's half-rotated layout."""
    return rows(w, qk_order(w.shape[0], n_heads))


def rotary_rows(n_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The q/k row order that puts a partially rotated head's pairs (i, i + rotary_dim / 2) where the RoPE kernel
    rotates pairs (i, i + head_dim / 2), and its unrotated dims in the rest, which turn by angle 0
    (model.rope_tables). Queries and keys are reordered alike, so their dot products are unchanged."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    ar = torch.arange
    head = torch.cat([ar(r), rotary_dim + ar(p), r + ar(r), rotary_dim + p + ar(p)])
    return (torch.arange(n_heads)[:, None] * head_dim + head).flatten()


def pad_heads(config: ModelConfig) -> ModelConfig:
    """A head size the attention kernels do not take (kvcache.dispatch.kernel_head_dim: not a multiple of 32, such as
    80 or 48) taken in the next one they do (96, 64): the projections stay as they are (proj_head_dim), and the
    model puts each head's two halves at the front of the padded head's halves (Transformer.head_cols), so RoPE's
    pairs stay pairs and the padding, zero, turns by angle 0 (rotary_dim) and adds nothing to q.k. The KV cache
    stores the padded heads. Not for per-head q/k norms, which the padding would change."""
    p = config.head_dim
    if kernel_head_dim(p) or p > 256 or p % 2 or config.qk_norm or config.proj_head_dim:
        return config
    config.proj_head_dim, config.rotary_dim = p, config.rotary_dim or p
    config.head_dim = max(32, -(-p // 32) * 32)
    return config


def arrange_rows(weights: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """Phi-3's fused qkv and gate_up matrices as the separate ones the model takes (and fuses again), and a
    partially rotated model's q/k rows in the order the RoPE kernel rotates (rotary_rows)."""
    hd = config.proj_head_dim or config.head_dim
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    bounds = {"qkv_proj": (0, q, q + kv, q + 2 * kv), "gate_up_proj": (0, config.ffn_dim, 2 * config.ffn_dim)}
    for key in [k for k in weights if k.rsplit(".", 1)[-1] in FUSED]:
        layer, part = key.rsplit(".", 1)
        w, b = weights.pop(key), bounds[part]
        weights.update({f"{layer}.{name}": rows(w, slice(b[j], b[j + 1])) for j, name in enumerate(FUSED[part])})
    if config.rotary_dim and config.rotary_dim != hd:
        for key in [k for k in weights if k.removesuffix(".bias").endswith((".q_proj", ".k_proj"))]:
            heads = config.n_heads if ".q_proj" in key else config.n_kv_heads
            weights[key] = rows(weights[key], rotary_rows(heads, hd, config.rotary_dim))
    return weights


def importance_of(importance: dict | None, name: str) -> torch.Tensor | None:
    """A matrix's input-column importance (localpd.quantize.calibrate); a fused matrix reads its parts' input."""
    part = name.rsplit(".", 1)[-1]
    return (importance or {}).get(name[:-len(part)] + FUSED[part][0] if part in FUSED else name)


def longrope(rope: dict, original: int, max_context: int) -> dict:
    """Phi's LongRoPE parameters as the model takes them (model.rope_tables), the attention factor as
    transformers derives it where the file gives none."""
    factor = rope.get("factor") or max_context / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"type": "longrope", "short_factor": [float(f) for f in rope["short_factor"]],
            "long_factor": [float(f) for f in rope["long_factor"]], "original_max_position_embeddings": int(original),
            "attention_factor": float(attention)}


def gguf_config(meta: dict, path: Path) -> ModelConfig:
    arch_name = meta.get("general.architecture", "?")
    if arch_name not in ARCHS:
        raise LocalpdError(f"unsupported architecture '{arch_name}' in {path}; supported: {', '.join(ARCHS)}")

    def get(key, default=None):
        v = meta.get(f"{arch_name}.{key}", default)
        if v is None:
            raise LocalpdError(f"{path} lacks metadata {arch_name}.{key}")
        return v

    dim, heads = int(get("embedding_length")), int(get("attention.head_count"))
    scaling = None
    if meta.get(f"{arch_name}.rope.scaling.type") == "llama3":
        scaling = {"factor": float(get("rope.scaling.factor")),
                   "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
    vocab = meta.get(f"{arch_name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    layers, step = int(get("block_count")), NOPE_STEP.get(arch_name)
    head_dim = int(get("attention.key_length", dim // heads))
    context, window = int(get("context_length", 4096)), int(get("attention.sliding_window", 0))
    config = ModelConfig(
        arch=ARCHS[arch_name], vocab_size=int(vocab), dim=dim, n_layers=layers,
        n_heads=heads, n_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, ffn_dim=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_context=min(context, window or context), sliding_window=window,
        qkv_bias=arch_name == "qwen2", qk_norm=arch_name == "qwen3",
        nope_layers=[i for i in range(layers) if step and (i + 1) % step == 0],
        rotary_dim=int(get("rope.dimension_count", head_dim)), name=str(meta.get("general.name", path.stem)),
    )
    if arch_name == "gemma3":  # as llama.cpp reads it: the layer pattern, the local RoPE base and the 27B's (62 layers)
        # q.k scale are fixed
        linear = meta.get("gemma3.rope.scaling.type") == "linear"
        gemma3(config, swa_layers=[i for i in range(layers) if window and (i + 1) % GEMMA3_GLOBAL_STEP],
               context=context, local_theta=10000.0, query_scalar=dim // heads if layers == 62 else head_dim,
               scaling={"type": "linear", "factor": float(get("rope.scaling.factor"))} if linear else None)
    return pad_heads(config)


def gemma3(config: ModelConfig, swa_layers: list[int], context: int, local_theta: float, query_scalar: float,
           scaling: dict | None) -> None:
    """What Gemma 3 adds to a config: the window in its sliding layers only (the context is not capped), their own
    RoPE base, the scaled embeddings, the norms around each sublayer, GELU and q.k's scale; q/k norms."""
    config.swa_layers, config.max_context, config.rope_local_theta = swa_layers, context, local_theta
    config.embed_scale, config.sandwich_norms, config.act = config.dim ** 0.5, True, "gelu_tanh"
    config.attn_scale, config.qk_norm, config.rope_scaling = query_scalar ** -0.5, True, scaling


def gguf_longrope(g: GGUFFile, config: ModelConfig, arch_name: str) -> dict | None:
    """LongRoPE as llama.cpp stores Phi's: the factors as tensors rope_factors_long/short, the original context
    and the attention factor as metadata."""
    names = {t.name for t in g.tensors}
    if "rope_factors_long.weight" not in names:
        return None
    meta = g.metadata
    original = meta.get(f"{arch_name}.rope.scaling.original_context_length")
    if original is None:
        raise LocalpdError(f"{g.path} has LongRoPE factors but no {arch_name}.rope.scaling.original_context_length")
    rope = {"short_factor": g.dequantize("rope_factors_short.weight").tolist(),
            "long_factor": g.dequantize("rope_factors_long.weight").tolist(),
            "attention_factor": meta.get(f"{arch_name}.rope.scaling.attn_factor")}
    return longrope(rope, int(original), int(meta.get(f"{arch_name}.context_length", original)))


def gguf_key(tensor_name: str) -> tuple[str, bool] | None:
    """A GGUF tensor's HF-style name and whether it is a bias (blk.3.attn_q.weight -> layers.3.q_proj, False);
    None for tensors the model does not use."""
    name = tensor_name.removesuffix(".weight")
    bias = name.endswith(".bias")
    name = name.removesuffix(".bias")
    if name.startswith("blk."):
        _, i, part = name.split(".", 2)
        return (f"layers.{i}.{GGUF_NAMES[part]}", bias) if part in GGUF_NAMES else None
    return (GGUF_TOP[name], bias) if name in GGUF_TOP else None


def gguf_tied(g: GGUFFile) -> bool:
    """Whether the output head is the token embeddings (the file has no output.weight)."""
    return not any(t.name == "output.weight" for t in g.tensors)


def load_gguf(path: Path, dtype, device, scheme: str = "native", importance: dict | None = None) -> LoadedModel:
    g = GGUFFile(path)
    config = gguf_config(g.metadata, path)
    config.tie_embeddings = gguf_tied(g)
    config.rope_scaling = gguf_longrope(g, config, g.metadata["general.architecture"]) or config.rope_scaling
    g.check_types(t.name for t in g.tensors if gguf_key(t.name))
    weights, trimmer = {}, heap.Trimmer()
    place = gguf_placement(g, scheme, config.tie_embeddings) if torch.device(device).type == "cpu" else None
    for t in g.tensors:
        if not (found := gguf_key(t.name)):
            continue
        key, bias = found
        if key.endswith(".up_proj") and int(t.shape[-1]) == 2 * config.ffn_dim:  # Phi-3's gate and up in one
            key = key.removesuffix("up_proj") + "gate_up_proj"
        heads = {"q_proj": config.n_heads, "k_proj": config.n_kv_heads}.get(key.rsplit(".", 1)[-1])
        if config.arch != "llama":
            heads = None  # only llama-arch GGUFs have permuted q/k rows
        if bias or not is_matrix(key, config.tie_embeddings):
            w = g.dequantize(t.name)
            if heads:
                w = unpermute_qk(w, heads)
            w = w.to(device=device, dtype=torch.float32 if key == "rope_freqs" else dtype)
            weights[key + (".bias" if bias else "")] = w
            continue
        weights[key] = gguf_matrix(g, t, head_scheme(key, scheme, config.tie_embeddings), dtype, device, heads,
                                   importance_of(importance, key), place.fields(t.name) if place else None)
        trimmer.add(weight_nbytes(weights[key]))  # the conversions' temporaries: else the heap keeps 0.5x the weights
        g.release(t.name)
    return LoadedModel(config, arrange_rows(weights, config), path, gguf=g)


def gguf_placement(g: GGUFFile, scheme: str, tied: bool) -> Placement | None:
    """Where the C import makes the file's matrices that it takes as they are stored (placement.py), or None where
    it does not run."""
    if not gguf_import.available():
        return None
    tensors = {}
    for t, key in gguf_matrices(g, tied):
        kind, s, shape = t.tensor_type.name, head_scheme(key, scheme, tied), tuple(reversed(t.shape))
        if imports_exactly(kind, s) and not imports_codes(kind, s) and gguf_import.field_specs(kind, shape):
            tensors[t.name] = (kind, shape)
    return Placement(tensors) if tensors else None


def gguf_matrices(g: GGUFFile, tied: bool):
    """The file's weight matrices (not biases, norms or an untied embedding), each with its HF-style name."""
    for t in g.tensors:
        key, bias = gguf_key(t.name) or (None, True)
        if not bias and is_matrix(key, tied):
            yield t, key


def imports_every_matrix_exactly(path: Path, scheme: str) -> bool:
    """Whether a GGUF file's matrices are all stored in the scheme's own format already (Q4_1 under int4-g32),
    so loading it re-quantizes nothing (and calibrating for the scheme would be wasted)."""
    if Path(path).suffix != ".gguf":
        return False
    g = GGUFFile(Path(path))
    tied = gguf_tied(g)
    return all(imports_exactly(t.tensor_type.name, head_scheme(key, scheme, tied)) for t, key in gguf_matrices(g, tied))


def gguf_matrix(g: GGUFFile, t, scheme: str, dtype, device, heads: int | None,
                importance: torch.Tensor | None = None, out: list[torch.Tensor] | None = None) -> Weight:
    """A GGUF weight matrix in the scheme; blocks already in the scheme's format are imported exactly (by the C
    import where it runs, into `out` if given: Placement.fields)."""
    kind, shape = t.tensor_type.name, tuple(reversed(t.shape))
    if imports_exactly(kind, scheme) or imports_codes(kind, scheme):
        w = gguf_import.import_matrix(kind, t.data, shape, qk_order(shape[0], heads) if heads else None, out)
        if w is None:  # no C import for it: the torch one (which names what is wrong with the blocks)
            try:
                w = from_gguf(kind, torch.from_numpy(np.array(t.data, dtype=np.uint8)), shape)
            except LocalpdError as e:
                raise LocalpdError(f"{g.path}: tensor {t.name}: {e}") from None
            w = unpermute_qk(w, heads) if heads else w
        w = from_blocks(w, scheme)
        return replace(w, **{f.name: getattr(w, f.name).to(device) for f in fields(w)})
    dense = g.dequantize(t.name).to(device)
    if heads:
        dense = unpermute_qk(dense, heads)
    return native_weight(dense, kind, dtype) if scheme == "native" else quantize(dense, scheme, dtype, importance)


# Gemma3TextConfig's defaults, which Gemma 3's own config.json files leave out
GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "tie_word_embeddings": True}


def hf_config(cfg: dict, path: Path) -> ModelConfig:
    mt = cfg.get("model_type", "?")
    if mt not in ARCHS:
        raise LocalpdError(f"unsupported architecture '{mt}' in {path}; supported: {', '.join(ARCHS)}")
    if mt in ("gemma3", "gemma3_text"):
        return hf_gemma3_config({**GEMMA3_DEFAULTS, **cfg.get("text_config", cfg)}, path)
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "longrope", None):
        raise LocalpdError(f"unsupported RoPE scaling '{rope_type}' in {path}")
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    head_dim = cfg.get("head_dim") or dim // heads
    partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    context = cfg.get("max_position_embeddings", 4096)
    scaling = dict(rope) if rope_type == "llama3" else None
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        scaling = longrope(rope, original or context, context)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    rope_layers = cfg.get("no_rope_layers")  # SmolLM3: 1 where a layer takes RoPE, 0 where it takes none
    if rope_layers is None and mt == "smollm3":
        step = cfg.get("no_rope_layer_interval", 4)
        rope_layers = [int((i + 1) % step != 0) for i in range(cfg["num_hidden_layers"])]
    return pad_heads(ModelConfig(
        arch=ARCHS[mt], vocab_size=cfg["vocab_size"], dim=dim, n_layers=cfg["num_hidden_layers"],
        n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta), rope_scaling=scaling, rotary_dim=int(head_dim * partial),
        max_context=min(context, window or context), sliding_window=window or 0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings")), qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3",
        nope_layers=[i for i, roped in enumerate(rope_layers or []) if not roped], name=path.name,
    ))


def hf_gemma3_config(cfg: dict, path: Path) -> ModelConfig:
    """Gemma 3 from its text config: RoPE per layer type (transformers 5's rope_parameters, or the hub files'
    rope_theta, rope_local_base_freq and rope_scaling), which layers slide (layer_types, or every 6th global)."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
    local = (rope.get("sliding_attention") or {}).get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise LocalpdError(f"unsupported RoPE scaling '{kind}' in {path}")
    layers = cfg["num_hidden_layers"]
    step = cfg.get("sliding_window_pattern", GEMMA3_GLOBAL_STEP)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % step == 0
                                       else "sliding_attention" for i in range(layers)]
    config = ModelConfig(
        arch="gemma3", vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=layers,
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        ffn_dim=cfg["intermediate_size"], norm_eps=cfg["rms_norm_eps"], rope_theta=float(full["rope_theta"]),
        rotary_dim=cfg["head_dim"],
        sliding_window=cfg["sliding_window"] or 0, tie_embeddings=bool(cfg["tie_word_embeddings"]), name=path.name)
    gemma3(config, swa_layers=[i for i, t in enumerate(types) if t == "sliding_attention" and cfg["sliding_window"]],
           context=cfg["max_position_embeddings"], local_theta=float(local), query_scalar=cfg["query_pre_attn_scalar"],
           scaling={"type": "linear", "factor": float(full["factor"])} if kind == "linear" else None)
    return config


def hf_weight_name(key: str, arch: str) -> str | None:
    """A safetensors tensor's name as the model takes it (None: not the language model's, e.g. Gemma 3's vision
    tower)."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if key.startswith(prefix):
            key = key.removeprefix(prefix)
            break
    if key.startswith(("vision_tower", "multi_modal_projector", "vision_model")):
        return None
    name = key.removesuffix(".weight").replace(".self_attn.", ".").replace(".mlp.", ".")
    if arch == "gemma3" and name.startswith("layers."):
        i, part = name.split(".")[1:3]
        name = f"layers.{i}.{GEMMA_NORMS.get(part, part)}" + name[len(f"layers.{i}.{part}"):]
    return name


def load_hf_dir(path: Path, dtype, device, scheme: str = "native", importance: dict | None = None) -> LoadedModel:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise LocalpdError(f"{path} has no config.json; not a Hugging Face model directory")
    raw = json.loads(cfg_file.read_text())
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method:  # weights packed for another engine: their tensors are not the model's float ones
        raise LocalpdError(f"{path} holds weights quantized by {method} (for vLLM/SGLang or transformers); localpd "
                           f"reads Hugging Face checkpoints in float32/float16/bfloat16 and GGUF files")
    config = hf_config(raw, path)
    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else [p.name for p in sorted(path.glob("*.safetensors"))])
    if not files:
        raise LocalpdError(f"{path} has no .safetensors weights")
    weights, trimmer = {}, heap.Trimmer()
    for fname in files:
        with safe_open(path / fname, framework="pt") as f:
            for k in f.keys():
                name = hf_weight_name(k, config.arch)
                if name is None or "rotary_emb" in name:
                    continue
                if config.tie_embeddings and name == "lm_head":
                    continue
                t = f.get_tensor(k).to(device)
                tied = config.tie_embeddings
                if is_matrix(name, tied):
                    weights[name] = quantize(t, head_scheme(name, scheme, tied), dtype, importance_of(importance, name))
                elif config.arch == "gemma3" and name.endswith("norm"):
                    weights[name] = (t.float() + 1).to(dtype)  # Gemma's norms scale by 1 + weight (GGUF stores it so)
                else:
                    weights[name] = t.to(dtype)
                trimmer.add(weight_nbytes(weights[name]))  # the quantization's temporaries (load_gguf's)
    return LoadedModel(config, arrange_rows(weights, config), path, hf_dir=path)
