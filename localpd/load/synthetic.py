"""Random weights with real models' shapes, built directly in a weight scheme, for benchmarks that must run
anywhere with no download: decode speed depends on the bytes moved, not on the values."""

from __future__ import annotations

from pathlib import Path

import torch

from localpd.model.config import ModelConfig, matrix_shapes
from localpd.errors import LocalpdError
from localpd.load.loader import GEMMA3_GLOBAL_STEP, LoadedModel
from localpd.quant.bnb import NF4_BLOCKSIZE, BnbInt8Weight, Nf4Weight
from localpd.quant.weights import Int4Weight, Int8Weight, Weight
from localpd.quant.int4k import Int4KWeight, super_blocks
from localpd.quant.schemes import DENSE, INT4, INT4_K, head_scheme, int4_group

# shapes from each model's config.json
def gemma3_layout(dim: int, layers: int, window: int) -> dict:
    """Gemma 3's ModelConfig fields besides the sizes (localpd.load.loader.gemma3)."""
    return dict(sliding_window=window, swa_layers=[i for i in range(layers) if (i + 1) % GEMMA3_GLOBAL_STEP], rope_local_theta=1e4,
                embed_scale=dim ** 0.5, sandwich_norms=True, act="gelu_tanh", attn_scale=256 ** -0.5)


SYNTHETIC = {
    "llama3-8b": ModelConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 1e-5, 500000.0, max_context=8192),
    "llama3.2-3b": ModelConfig("llama", 128256, 3072, 28, 24, 8, 128, 8192, 1e-5, 500000.0, max_context=8192,
                               tie_embeddings=True),
    "llama3.2-1b": ModelConfig("llama", 128256, 2048, 16, 32, 8, 64, 8192, 1e-5, 500000.0, max_context=8192,
                               tie_embeddings=True),
    "qwen2.5-7b": ModelConfig("qwen2", 152064, 3584, 28, 28, 4, 128, 18944, 1e-6, 1000000.0, max_context=8192,
                              qkv_bias=True),
    "qwen2.5-0.5b": ModelConfig("qwen2", 151936, 896, 24, 14, 2, 64, 4864, 1e-6, 1000000.0, max_context=8192,
                                tie_embeddings=True, qkv_bias=True),
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 1e-6, 1000000.0, max_context=8192,
                            qk_norm=True),
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 1e-6, 1000000.0, max_context=8192,
                              tie_embeddings=True, qk_norm=True),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 100000.0, max_context=8192,
                                tie_embeddings=True),
    # heads of 96, which the kernels take in tiles of 128 with the last 32 columns masked; LongRoPE left out
    "phi3.5-mini": ModelConfig("phi3", 32064, 3072, 32, 32, 32, 96, 8192, 1e-5, 10000.0, max_context=8192),
    "gemma3-1b": ModelConfig("gemma3", 262144, 1152, 26, 4, 1, 256, 6912, 1e-6, 1000000.0, max_context=8192,
                             tie_embeddings=True, qk_norm=True, **gemma3_layout(1152, 26, 512)),
    "gemma3-4b": ModelConfig("gemma3", 262208, 2560, 34, 8, 4, 256, 10240, 1e-6, 1000000.0, max_context=8192,
                             tie_embeddings=True, qk_norm=True, rope_scaling={"type": "linear", "factor": 8.0},
                             **gemma3_layout(2560, 34, 1024)),
}


def random_weight(shape: tuple[int, int], scheme: str, dtype: torch.dtype, device, g: torch.Generator) -> Weight:
    """Values of about +-0.02 in the scheme's own format, without a dense copy first."""
    n, k = shape
    if scheme in INT4:
        group = int4_group(scheme, k)
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device, generator=g)
        scales = torch.full((n, k // group), 0.02 / 7.5, dtype=torch.float16, device=device)
        return Int4Weight(packed, scales, torch.full_like(scales, -0.02))
    if scheme == INT4_K:  # each group's scale 128 d = 0.02 / 7.5 and bias -127 dmin = -0.02
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device, generator=g)
        d = torch.full((n, super_blocks(k)), 0.02 / 7.5 / 128, dtype=torch.float16, device=device)
        sub = torch.cat([torch.full((n, k // 32), 128, dtype=torch.uint8, device=device),
                         torch.full((n, k // 32), -127, dtype=torch.int8, device=device).view(torch.uint8)], dim=1)
        return Int4KWeight(packed, d, torch.full_like(d, 0.02 / 127), sub)
    if scheme == "int8":
        data = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
        return Int8Weight(data, torch.full((n, 1), 0.02 / 127, dtype=torch.float16, device=device))
    if scheme == "bnb-nf4":
        if k % NF4_BLOCKSIZE:
            raise LocalpdError(f"bnb-nf4 needs input dimensions divisible by {NF4_BLOCKSIZE}; {k} is not")
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
        return Nf4Weight(data, torch.full((n, k // NF4_BLOCKSIZE), 0.02, device=device))
    if scheme == "bnb-int8":
        data = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
        return BnbInt8Weight(data, torch.full((n, 1), 0.02, device=device))
    return (torch.randn(n, k, device=device, generator=g, dtype=torch.float32) * 0.02).to(dtype)


def synthetic_model(name: str, scheme: str, dtype: torch.dtype, device, seed: int = 0) -> LoadedModel:
    if name not in SYNTHETIC:
        raise LocalpdError(f"unknown synthetic model '{name}'; choose one of {', '.join(SYNTHETIC)}")
    c = SYNTHETIC[name]
    c = ModelConfig(**{**c.__dict__, "name": name})
    scheme = "bf16" if scheme == "native" else scheme
    dense = DENSE.get(scheme, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, Weight] = {}
    for wname, shape in matrix_shapes(c).items():
        weights[wname] = random_weight(shape, head_scheme(wname, scheme, c.tie_embeddings), dense, device, g)
    embed_scheme = head_scheme("embed_tokens", scheme, True) if c.tie_embeddings else "dense"
    weights["embed_tokens"] = random_weight((c.vocab_size, c.dim), embed_scheme, dense, device, g)
    if c.qkv_bias:
        for i in range(c.n_layers):
            for proj, n in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads)):
                width = n * (c.proj_head_dim or c.head_dim)
                weights[f"layers.{i}.{proj}_proj.bias"] = torch.zeros(width, dtype=dense, device=device)
    ones = torch.ones(c.dim, dtype=dense, device=device)
    for i in range(c.n_layers):
        weights[f"layers.{i}.input_layernorm"] = ones
        weights[f"layers.{i}.post_attention_layernorm"] = ones
        if c.qk_norm:
            weights[f"layers.{i}.q_norm"] = weights[f"layers.{i}.k_norm"] = ones[:c.head_dim]
        if c.sandwich_norms:
            weights[f"layers.{i}.attn_out_norm"] = weights[f"layers.{i}.mlp_out_norm"] = ones
    weights["norm"] = ones
    return LoadedModel(c, weights, Path(f"synthetic:{name}"))


def synthetic_nbytes(name: str, scheme: str) -> int:
    """Bytes the weights will take, to skip what does not fit before building it."""
    c = SYNTHETIC[name]
    scheme = "bf16" if scheme == "native" else scheme

    def size(shape, s):
        n, k = shape
        if s in INT4:
            return n * k // 2 + 4 * n * (k // int4_group(s, k))
        if s == INT4_K:
            return n * k // 2 + 2 * n * (k // 32) + 4 * n * super_blocks(k)
        if s == "int8":
            return n * k + 2 * n
        if s == "bnb-nf4":
            return n * k // 2 + 4 * n * (k // NF4_BLOCKSIZE)
        if s == "bnb-int8":
            return n * k + 4 * n
        return n * k * (4 if s == "fp32" else 2)

    total = sum(size(shape, head_scheme(w, scheme, c.tie_embeddings)) for w, shape in matrix_shapes(c).items())
    embed = head_scheme("embed_tokens", scheme, True) if c.tie_embeddings else "bf16"
    return total + size((c.vocab_size, c.dim), embed)
