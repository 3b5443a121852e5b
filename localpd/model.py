"""The Llama-family transformer (Llama 2/3, SmolLM, Mistral, Qwen2) with separate prefill and decode paths.

Weights arrive as a flat dict with HF-style names (see localpd.loader). One forward call runs an engine step: any
mix of prompt chunks (attending causally to their cached prefix plus themselves) and single decode tokens of
several sequences, whose keys and values live in a paged KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localpd.config import ModelConfig
from localpd.errors import LocalpdError
from localpd.kernels.dispatch import linear_int4, linear_int8
from localpd.kernels.kv_dispatch import paged_attention, write_kv
from localpd.quant.kv import KVPool
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

    @property
    def params(self) -> int:
        n, k = self.weight.shape
        return n * k


class StackedLinear:
    """Projections of one input whose weights cannot share one matrix (different formats): outputs concatenated."""

    def __init__(self, parts: list[QuantLinear]):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts)


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


@dataclass
class Batch:
    """One engine step: the new tokens of several sequences, concatenated, and where their keys and values go.

    Sequence b owns rows q_starts[b]:q_starts[b + 1]; its keys are positions 0 .. seq_lens[b] - 1, at page
    page_table[b, pos // page_size]. slots[i] = page * page_size + offset is where token i's K/V are written.
    logit_rows: the rows whose next-token logits are wanted."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    q_starts: torch.Tensor  # [B + 1] int32
    logit_rows: torch.Tensor  # [R] int64

    @classmethod
    def single(cls, tokens: list[int], start: int, n_pages: int, page_size: int, device, all_logits: bool = False):
        """One sequence whose pages are 0 .. n_pages - 1 in order (position p at slot p): perplexity, tests."""
        n = len(tokens)
        positions = torch.arange(start, start + n, device=device)
        rows = torch.arange(n, device=device) if all_logits else torch.tensor([n - 1], device=device)
        return cls(torch.tensor(tokens, device=device), positions, positions.clone(),
                   torch.arange(n_pages, dtype=torch.int32, device=device)[None],
                   torch.tensor([start + n], dtype=torch.int32, device=device),
                   torch.tensor([0, n], dtype=torch.int32, device=device), rows)


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

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions.float(), self.inv_freq)
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

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: KVPool) -> torch.Tensor:
        """Run a step's tokens, writing their keys and values into the paged cache; returns the float32 logits
        of batch.logit_rows ([R, vocab])."""
        c = self.config
        T = batch.tokens.shape[0]
        cos, sin = self._rope(batch.positions)
        scale = 1.0 / math.sqrt(c.head_dim)
        x = take_rows(self.embed, batch.tokens, self.dtype)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin)
            pages = kv.layer(li)
            write_kv(pages, k, v, batch.slots)
            attn = paged_attention(q, pages, batch.page_table, batch.seq_lens, batch.q_starts, scale)
            x = x + layer.o(attn.reshape(T, c.n_heads * c.head_dim))
            x = x + self._mlp(layer, x)
        x = rms_norm(x[batch.logit_rows], self.norm, c.norm_eps)
        return self.lm_head(x).float()

    def _body(self):
        linears = [l for L in self.layers for l in (L.qkv, L.o, L.gate_up, L.down)]
        norms = [self.norm] + [t for L in self.layers for t in (L.attn_norm, L.mlp_norm)]
        return linears, norms

    @property
    def body_bytes(self) -> int:
        """Bytes every step reads whatever its size: all layers' matrices and norms (not the embedding or head)."""
        linears, norms = self._body()
        return sum(l.nbytes for l in linears) + sum(weight_nbytes(t) for t in norms)

    @property
    def body_params(self) -> int:
        return sum(l.params for l in self._body()[0])

    @property
    def embed_row_bytes(self) -> int:
        """Bytes of one token's embedding row (scales included for a quantized embedding)."""
        return weight_nbytes(self.embed) // self.config.vocab_size

    @property
    def weight_bytes(self) -> int:
        """The bytes of one decode step's weights: the body, the output head and one embedding row."""
        return self.body_bytes + self.lm_head.nbytes + self.embed_row_bytes
