"""The Llama-family transformer (Llama 2/3, SmolLM, Mistral, Qwen2) with separate prefill and decode paths.

Weights arrive as a flat dict with HF-style names (see localpd.loader). Prefill runs a whole chunk of prompt
tokens through the layers and attends causally over the cached prefix plus the chunk; decode runs one token
and attends over everything cached. Both write their keys and values into the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localpd.config import ModelConfig
from localpd.errors import LocalpdError
from localpd.kernels.dispatch import linear_int4, linear_int8
from localpd.quant.weights import Int4Weight, Int8Weight, Weight, cat_rows, take_rows, weight_nbytes


class QuantLinear:
    """y = x @ W.T (+ b) for a dense, int8 or int4 weight: the one place model code touches a weight matrix,
    so the model never branches on the format."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Int4Weight):
            return linear_int4(x, w, self.bias)
        if isinstance(w, Int8Weight):
            return linear_int8(x, w, self.bias)
        return F.linear(x, w, self.bias)

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self.weight) + (0 if self.bias is None else weight_nbytes(self.bias))


class StackedLinear:
    """Projections of one input whose weights cannot share one matrix (different formats): outputs concatenated."""

    def __init__(self, parts: list[QuantLinear]):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def fuse(parts: list[QuantLinear]) -> QuantLinear | StackedLinear:
    """One matrix for projections that read the same input (q/k/v, gate/up): one launch instead of several."""
    weights = [p.weight for p in parts]
    kinds = {(type(w), getattr(w, "group", None), getattr(w, "dtype", None)) for w in weights}
    if len(kinds) > 1:
        return StackedLinear(parts)
    biases = [p.bias for p in parts]
    bias = None if any(b is None for b in biases) else torch.cat(biases)
    return QuantLinear(cat_rows(weights), bias)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: QuantLinear | StackedLinear  # q, k and v stacked along the output dimension
    o: QuantLinear
    mlp_norm: torch.Tensor
    gate_up: QuantLinear | StackedLinear  # gate and up stacked along the output dimension
    down: QuantLinear


class KVCache:
    """One sequence's keys and values, contiguous: [layers, max_len, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (config.n_layers, max_len, config.n_kv_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # only [:length] is ever read
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose K/V are valid

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE for half the head dimension, with Llama 3.1 scaling where configured."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if rope_freqs is not None:  # GGUF stores Llama 3.1's scaling as per-frequency divisors
        return (inv / rope_freqs.double()).float()
    s = config.rope_scaling
    if s:
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in HF's half-rotated layout; cos/sin: [T, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        w = dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise LocalpdError(f"model weights lack tensor '{name}'")
            return w.pop(name)

        def linear(name: str) -> QuantLinear:
            return QuantLinear(take(name), w.pop(name + ".bias", None))

        self.embed = take("embed_tokens")
        self.layers = [
            Layer(
                attn_norm=take(f"layers.{i}.input_layernorm"),
                qkv=fuse([linear(f"layers.{i}.{n}_proj") for n in "qkv"]),
                o=linear(f"layers.{i}.o_proj"),
                mlp_norm=take(f"layers.{i}.post_attention_layernorm"),
                gate_up=fuse([linear(f"layers.{i}.gate_proj"), linear(f"layers.{i}.up_proj")]),
                down=linear(f"layers.{i}.down_proj"),
            )
            for i in range(config.n_layers)
        ]
        self.norm = take("norm")
        self.lm_head = QuantLinear(self.embed) if config.tie_embeddings else linear("lm_head")
        self.dtype = self.norm.dtype
        self.device = self.norm.device
        self.inv_freq = rope_inv_freq(config, w.pop("rope_freqs", None)).to(self.device)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.config, max_len or self.config.max_context, self.dtype, self.device)

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, device=self.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        return angles.cos(), angles.sin()

    def _qkv(self, layer: Layer, x: torch.Tensor, cos, sin):
        c = self.config
        T = x.shape[0]
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = layer.qkv(x).split([nq, nkv, nkv], dim=-1)
        q = q.view(T, c.n_heads, c.head_dim)
        k = k.view(T, c.n_kv_heads, c.head_dim)
        v = v.reshape(T, c.n_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.mlp_norm, self.config.norm_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def _check_room(self, cache: KVCache, n: int) -> int:
        start = cache.length
        if start + n > cache.max_len:
            raise LocalpdError(f"context full: {start} cached + {n} new tokens exceed the context of {cache.max_len}")
        return start

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run a chunk of prompt tokens [T] after the cache's contents. Returns logits of the last position
        ([vocab], float32), or of every position ([T, vocab]) with all_logits."""
        c = self.config
        T = tokens.shape[0]
        start = self._check_room(cache, T)
        end = start + T
        cos, sin = self._rope(start, T)
        # causal over prefix + chunk: query i (absolute start + i) sees keys 0 .. start + i
        mask = torch.ones(T, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        x = take_rows(self.embed, tokens, self.dtype)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.k[li, start:end] = k
            cache.v[li, start:end] = v
            keys, values = cache.k[li, :end], cache.v[li, :end]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, enable_gqa=True,
            )
            x = x + layer.o(attn.transpose(0, 1).reshape(T, c.n_heads * c.head_dim))
            x = x + self._mlp(layer, x)
        cache.length = end
        x = rms_norm(x if all_logits else x[-1:], self.norm, c.norm_eps)
        logits = self.lm_head(x).float()
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def decode(self, token: int, cache: KVCache) -> torch.Tensor:
        """Run one token after the cache's contents; returns its logits ([vocab], float32)."""
        c = self.config
        pos = self._check_room(cache, 1)
        end = pos + 1
        cos, sin = self._rope(pos, 1)
        x = take_rows(self.embed, torch.tensor([token], device=self.device), self.dtype)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.k[li, pos] = k[0]
            cache.v[li, pos] = v[0]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), cache.k[li, :end].transpose(0, 1), cache.v[li, :end].transpose(0, 1),
                enable_gqa=True,
            )
            x = x + layer.o(attn.transpose(0, 1).reshape(1, c.n_heads * c.head_dim))
            x = x + self._mlp(layer, x)
        cache.length = end
        return self.lm_head(rms_norm(x, self.norm, c.norm_eps)).float()[0]

    @property
    def weight_bytes(self) -> int:
        linears = [self.lm_head] + [l for L in self.layers for l in (L.qkv, L.o, L.gate_up, L.down)]
        norms = [self.norm] + [t for L in self.layers for t in (L.attn_norm, L.mlp_norm)]
        return sum(l.nbytes for l in linears) + sum(weight_nbytes(t) for t in norms)
