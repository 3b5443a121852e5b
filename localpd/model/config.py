"""Model hyper-parameters, independent of where the weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama 2/3, SmolLM 1-3, Mistral), "qwen2", "qwen3", "phi3" (Phi-3, Phi-3.5, Phi-4), "gemma3"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 style scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; LongRoPE (Phi-3.5, Phi-4-mini): {"type": "longrope", "short_factor",
    # "long_factor", "original_max_position_embeddings", "attention_factor"}; linear (Gemma 3's global layers):
    # {"type": "linear", "factor"}; None for plain RoPE.
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # dims of a head that RoPE rotates (Phi-4-mini: 3/4 of them); 0: all
    # the model's attention window (Phi-3-mini-4k, Mistral 7B v0.1), 0 for none: localpd attends to the whole
    # context, which is the same while the context fits in the window, so max_context is capped at it; unless
    # swa_layers names the layers that take the window (Gemma 3: five in six), which the attention kernels apply
    sliding_window: int = 0
    swa_layers: list[int] = field(default_factory=list)
    rope_local_theta: float = 0.0  # RoPE base of the swa_layers (Gemma 3: 10000; they take no rope_scaling); 0: same
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(dim))
    sandwich_norms: bool = False  # Gemma: an RMSNorm on the attention's and the MLP's outputs too, before each add
    act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma)
    attn_scale: float = 0.0  # the softmax scale of q.k; 0: 1 / sqrt(the projections' head size)
    # the head size q, k and v's projections make where the attention and KV cache take a larger one (heads of 80
    # in heads of 96, which the Triton kernels take; loader.pad_heads); 0: head_dim
    proj_head_dim: int = 0
    max_context: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    nope_layers: list[int] = field(default_factory=list)  # layers whose attention takes no RoPE (SmolLM3: every 4th)
    name: str = ""
    extra: dict = field(default_factory=dict)


def matrix_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of every projection the model multiplies by (the tied output head is the embedding)."""
    q, kv = c.n_heads * (c.proj_head_dim or c.head_dim), c.n_kv_heads * (c.proj_head_dim or c.head_dim)
    shapes = {}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "q_proj": (q, c.dim), p + "k_proj": (kv, c.dim), p + "v_proj": (kv, c.dim),
                       p + "o_proj": (c.dim, q), p + "gate_proj": (c.ffn_dim, c.dim),
                       p + "up_proj": (c.ffn_dim, c.dim), p + "down_proj": (c.dim, c.ffn_dim)})
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.dim)
    return shapes
