"""The Llama-family transformer (Llama 2/3, SmolLM 1-3, Mistral, Qwen2, Qwen3, Phi-3/4, Gemma 3) with separate
prefill and decode paths.

Weights arrive as a flat dict with HF-style names (see localpd.load.loader). One forward call runs an engine step: any
mix of prompt chunks (attending causally to their cached prefix plus themselves) and single decode tokens of
several sequences, whose keys and values live in a paged KV cache.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, replace

import torch

from localpd import heap
from localpd.errors import LocalpdError
from localpd.kernels import cpu
from localpd.kernels.dispatch import as_int4, as_int8, use_triton
from localpd.kernels.fused_dispatch import act_mul, add_rms_norm, qk_norm
from localpd.kvcache.dispatch import paged_attention, rope_write_kv, rope_write_kv_ref, rounds_output
from localpd.model.config import ModelConfig
from localpd.model.linear import QuantLinear, StackedLinear, fuse, normed_separately
from localpd.quant.codebook import CodebookWeight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import SubScaled
from localpd.quant.kmajor import to_kmajor, to_strips
from localpd.quant.tinygemm import to_tinygemm
from localpd.kvcache.formats import KVPool
from localpd.quant.weights import Int4Weight, Int8Weight
from localpd.quant.weights import take_rows, weight_nbytes


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: QuantLinear | StackedLinear  # q, k and v stacked along the output dimension
    o: QuantLinear
    mlp_norm: torch.Tensor
    gate_up: QuantLinear | StackedLinear  # gate and up stacked along the output dimension
    down: QuantLinear
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm weights [head_dim] of each query and key head
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: RMSNorm weights of the attention's and the MLP's outputs
    mlp_out_norm: torch.Tensor | None = None


@dataclass
class Batch:
    """One engine step: the new tokens of several sequences, concatenated, and where their keys and values go.

    Sequence b owns rows q_starts[b]:q_starts[b + 1]; its keys are positions 0 .. seq_lens[b] - 1, at page
    page_table[b, pos // page_size]. slots[i] = page * page_size + offset is where token i's K/V are written.
    logit_rows: the rows whose next-token logits are wanted. stage_slots[i] = r * page_size + offset, r the
    sequence's row in the KV pool's stage (per-page KV formats keep the open page there as computed; kvcache.formats);
    without them such pages are re-quantized from their codes."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    q_starts: torch.Tensor  # [B + 1] int32
    logit_rows: torch.Tensor  # [R] int64
    stage_slots: torch.Tensor | None = None  # [T] int64

    @classmethod
    def single(cls, tokens: list[int], start: int, n_pages: int, page_size: int, device, all_logits: bool = False):
        """One sequence whose pages are 0 .. n_pages - 1 in order (position p at slot p), stage row 0: perplexity,
        tests."""
        n = len(tokens)
        positions = torch.arange(start, start + n, device=device)
        rows = torch.arange(n, device=device) if all_logits else torch.tensor([n - 1], device=device)
        return cls(torch.tensor(tokens, device=device), positions, positions.clone(),
                   torch.arange(n_pages, dtype=torch.int32, device=device)[None],
                   torch.tensor([start + n], dtype=torch.int32, device=device),
                   torch.tensor([0, n], dtype=torch.int32, device=device), rows, positions % page_size)


def head_cols(config: ModelConfig) -> torch.Tensor:
    """Where each projected q/k/v column goes in the padded heads (loader.pad_heads): each half of a head of
    proj_head_dim to the front of the same half of a head of head_dim."""
    p, d = config.proj_head_dim, config.head_dim
    head = torch.cat([torch.arange(p // 2), d // 2 + torch.arange(p // 2)])
    heads = config.n_heads + 2 * config.n_kv_heads
    return (torch.arange(heads)[:, None] * d + head).flatten()


def rope_tables(config: ModelConfig, rope_freqs: torch.Tensor | None = None,
                context: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE's inverse frequencies for the head_dim / 2 pairs the kernels rotate, and the factor cos and sin are
    scaled by (None: 1). Llama 3.1 scaling where configured; LongRoPE (Phi) with its long factors where the
    context runs past the original one (as llama.cpp decides, once for the whole cache) and its attention factor.
    A partially rotated head (rotary_dim < head_dim; the loader has put its unrotated dims at the end of each half,
    localpd.load.loader.rotary_rows) gets frequency 0 and factor 1 there: those pairs turn by angle 0."""
    hd = config.head_dim
    rd = config.rotary_dim or hd
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    s = config.rope_scaling or {}
    attention = None
    if rope_freqs is not None:  # GGUF stores Llama 3.1's scaling as per-frequency divisors
        inv = inv / rope_freqs.double()
    elif s.get("type") == "linear":
        inv = inv / s["factor"]
    elif s.get("type") == "longrope":
        long = (context or config.max_context) > s["original_max_position_embeddings"]
        factors = s["long_factor" if long else "short_factor"]
        if len(factors) != rd // 2:
            raise LocalpdError(f"LongRoPE needs {rd // 2} factors (one per rotated pair), the model gives {len(factors)}")
        inv = inv / torch.tensor(factors, dtype=torch.float64)
        attention = s["attention_factor"]
    elif s:
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    pad = torch.zeros((hd - rd) // 2, dtype=torch.float64)
    scale = None
    if attention is not None and attention != 1.0:
        scale = torch.cat((torch.full((rd // 2,), attention, dtype=torch.float64), pad + 1)).float()
    return torch.cat((inv, pad)).float(), scale


def gpu_form(w, card: str, strips: bool, dtype: torch.dtype, rows_read: bool = False):
    """An int4/int8 matrix (int4-k's as its int4 groups, a codebook's as its int8 values, a 5- or 6-bit one's as its
    nearest int8) in the K-major layout the batch-1 GEMV streams (quant/kmajor.py), in strips of 4 outputs where
    kernels/gemv_strip.py's GEMV decodes on this card (strips: holds_strips), or in torch's tinygemm layout where
    kernels/tinygemm.py's table says tinygemm ran this shape faster on this card than that GEMV (not for a matrix
    whose rows are read, rows_read: a tied head's embedding lookup); any other weight as it is."""
    from localpd.kernels import gemv_strip, tinygemm
    from localpd.kernels.gemv_kmajor import takes  # imports Triton

    if isinstance(w, Int4KWeight):
        w = as_int4(w)
    elif isinstance(w, (CodebookWeight, Int5Weight, Int5KWeight, SubScaled)):
        w = as_int8(w)
    bits = 4 if isinstance(w, Int4Weight) else 8 if isinstance(w, Int8Weight) else 0
    if not bits or not takes(w.shape, bits, w.group):  # else the row-major kernels, as before
        return w
    in_strips = strips and gemv_strip.takes(w.shape, bits, w.group)
    if bits == 4 and not rows_read and tinygemm.holds(card, "strip" if in_strips else "kmajor", w, dtype):
        return to_tinygemm(w, dtype)
    return to_strips(w) if in_strips else to_kmajor(w)


class Transformer:
    # False runs the steps between the matmuls as kernels of their own (RMSNorm, SiLU * mul, RoPE, the K and V
    # writes), as before the fusions: for measuring what the fusions save (scripts/bench_decode_peers.py)
    fused = True
    # False keeps the row-major int4/int8 kernels on a GPU instead of the K-major GEMV's layout (_to_gpu_layout): for
    # measuring what the layout gains (scripts/bench_decode_peers.py); read when a model is built
    gpu_layout = True

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], context: int | None = None, *,
                 consume: bool = False):
        """context: the longest sequence the caller will run (LongRoPE picks its factors by it; default: the
        model's own maximum). consume: take each weight out of `weights` as it is used (the dict is left empty), so
        that the parts of a fused matrix (q/k/v, gate/up) are freed as it is made and the build holds one copy of
        the weights, not two."""
        self.config = config
        w = weights if consume else dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise LocalpdError(f"model weights lack tensor '{name}'")
            return w.pop(name)

        def linear(name: str) -> QuantLinear:
            return QuantLinear(take(name), w.pop(name + ".bias", None))

        def layer(i: int) -> Layer:
            return Layer(
                attn_norm=take(f"layers.{i}.input_layernorm"),
                qkv=fuse([linear(f"layers.{i}.{n}_proj") for n in "qkv"]),
                o=linear(f"layers.{i}.o_proj"),
                mlp_norm=take(f"layers.{i}.post_attention_layernorm"),
                gate_up=fuse([linear(f"layers.{i}.gate_proj"), linear(f"layers.{i}.up_proj")]),
                down=linear(f"layers.{i}.down_proj"),
                q_norm=take(f"layers.{i}.q_norm") if config.qk_norm else None,
                k_norm=take(f"layers.{i}.k_norm") if config.qk_norm else None,
                attn_out_norm=take(f"layers.{i}.attn_out_norm") if config.sandwich_norms else None,
                mlp_out_norm=take(f"layers.{i}.mlp_out_norm") if config.sandwich_norms else None,
            )

        self.embed = take("embed_tokens")
        self.layers, trimmer = [], heap.Trimmer()
        for i in range(config.n_layers):
            self.layers.append(layer(i))
            if consume:  # the freed parts fit no later fused matrix: the heap would keep them
                trimmer.add(self.layers[-1].qkv.nbytes + self.layers[-1].gate_up.nbytes)
        self.norm = take("norm")
        self.lm_head = QuantLinear(self.embed) if config.tie_embeddings else linear("lm_head")
        self.dtype = self.norm.dtype
        self.device = self.norm.device
        inv_freq, rope_scale = rope_tables(config, w.pop("rope_freqs", None), context)
        self.inv_freq = inv_freq.to(self.device)
        self.rope_scale = None if rope_scale is None else rope_scale.to(self.device)
        self.local_inv_freq = None  # the sliding-window layers' own RoPE base (Gemma 3)
        if config.swa_layers and config.rope_local_theta:
            local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.local_inv_freq = rope_tables(local)[0].to(self.device)
        self.head_cols = head_cols(config).to(self.device) if config.proj_head_dim else None
        if self.device.type == "cuda" and self.gpu_layout:  # the GPU GEMV's layout of the int4/int8 matrices, in place of theirs
            self._to_gpu_layout()
        if self.device.type == "cpu":  # the CPU kernels' weights in one buffer on huge pages
            linears = [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]
            cpu.gather_weights([part.weight for lin in linears for part in getattr(lin, "parts", [lin])]
                               + [self.embed])  # a StackedLinear (int4 beside int8) gathers each of its parts

    def _to_gpu_layout(self) -> None:
        """Every int4/int8 matrix moved to the layout the GPU's batch-1 GEMV streams (gpu_form); a tied output head
        keeps one copy, which the embedding lookup reads too."""
        from localpd.kernels import gemv_strip

        strips = gemv_strip.holds_strips(self.device)
        card = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""  # "": tests, interpreted
        tied = self.lm_head.weight is self.embed
        linears = [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]
        for lin in linears:
            for part in getattr(lin, "parts", [lin]):
                part.weight = gpu_form(part.weight, card, strips, self.dtype, rows_read=tied and lin is self.lm_head)
        if tied:
            self.embed = self.lm_head.weight

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: torch.Tensor | None = None):
        angles = torch.outer(positions.float(), inv_freq)
        if scale is None:
            return angles.cos(), angles.sin()
        return angles.cos() * scale, angles.sin() * scale

    @torch.inference_mode()
    def _o_input(self, layer, q: torch.Tensor, pages, seq_lens: torch.Tensor):
        """Where the o projection's integer GEMV would round its input in a launch of its own, the buffers that the
        decode attention's reduce rounds its output into instead (kvcache.dispatch.rounds_output), else None."""
        rounding = getattr(layer.o, "input_rounding", None)
        if not self.fused or self.head_cols is not None or rounding is None or not rounds_output(q, pages, seq_lens):
            return None
        from localpd.kernels.act_round import Rounded  # Triton's module: a GPU (or interpreted) step only

        T, heads, D = q.shape
        bits = rounding(T, q)
        return Rounded.empty(T, heads * D, bits, q.device) if bits else None

    def forward(self, batch: Batch, kv: KVPool, hidden: bool = False, logits: bool = True):
        """Run a step's tokens, writing their keys and values into the paged cache; returns the float32 logits
        of batch.logit_rows ([R, vocab]), and with hidden (logits, their last hidden states with the final norm
        applied ([R, dim], float32: what an embedding pools)), the logits None without logits (a step of
        embeddings alone does not run the output head). x is the residual stream and out the last sublayer's
        output, not yet added to it: each projection after a norm adds it and normalises (QuantLinear.normed)."""
        c = self.config
        T = batch.tokens.shape[0]
        rope = self._rope(batch.positions, self.inv_freq, self.rope_scale)
        # a layer without RoPE (SmolLM3's every 4th) rotates by angle 0: cos 1 and sin 0 leave q and k as they are
        nope, swa = set(c.nope_layers), set(c.swa_layers)
        still = (torch.ones_like(rope[0]), torch.zeros_like(rope[1])) if nope else None
        local = rope if self.local_inv_freq is None else self._rope(batch.positions, self.local_inv_freq)
        scale = c.attn_scale or 1.0 / math.sqrt(c.proj_head_dim or c.head_dim)
        heads = c.n_heads + 2 * c.n_kv_heads
        if self.fused:
            normed, write = (lambda lin, *a: lin.normed(*a)), rope_write_kv
            gated = lambda lin, gu: lin.gated(gu, c.act)  # noqa: E731
        else:
            normed, gated, write = normed_separately, (lambda lin, gu: lin(act_mul(gu, c.act))), rope_write_kv_ref
        out, x = take_rows(self.embed, batch.tokens, self.dtype), None
        if c.embed_scale != 1.0:
            out = out * c.embed_scale
        # int4ch pages round their open page from the stage: a step without stage slots goes op by op (the reference)
        staged = batch.stage_slots is not None or not kv.has_stage
        plans = self._cpu_layer_plans(kv, T) if self.fused and staged else None
        if plans is not None:  # each layer in one call of localpd's CPU kernels
            out, x = self._cpu_layers(plans, batch, kv, out, rope, local, scale)
        for li, layer in enumerate(self.layers if plans is None else []):
            pages = kv.layer(li)
            qkv, x = normed(layer.qkv, out, x, layer.attn_norm, c.norm_eps)
            if self.head_cols is not None:  # projected heads into the wider ones the attention takes
                qkv = qkv.new_zeros(T, heads * c.head_dim).index_copy_(1, self.head_cols, qkv)
            if layer.q_norm is not None:
                qk_norm(qkv, layer.q_norm, layer.k_norm, c.n_heads, c.n_kv_heads, c.norm_eps)
            rot_cos, rot_sin = still if li in nope else local if li in swa else rope
            q = write(qkv, rot_cos, rot_sin, pages, batch.slots, c.n_heads, c.n_kv_heads, batch.stage_slots)
            rounded = self._o_input(layer, q, pages, batch.seq_lens)
            attn = paged_attention(q, pages, batch.page_table, batch.seq_lens, batch.q_starts, scale,
                                   c.sliding_window if li in swa else 0, round_into=rounded,
                                   stage_slots=batch.stage_slots)
            attn = attn.reshape(T, c.n_heads * c.head_dim)
            if self.head_cols is not None:
                attn = attn[:, self.head_cols[:c.n_heads * c.proj_head_dim]]
            out = layer.o(attn) if rounded is None else layer.o(attn, rounded=rounded)
            if layer.attn_out_norm is not None:
                out = add_rms_norm(out, None, layer.attn_out_norm, c.norm_eps)[0]
            gate_up, x = normed(layer.gate_up, out, x, layer.mlp_norm, c.norm_eps)
            out = gated(layer.down, gate_up)
            if layer.mlp_out_norm is not None:
                out = add_rms_norm(out, None, layer.mlp_out_norm, c.norm_eps)[0]
        rows = batch.logit_rows
        scores = normed(self.lm_head, out[rows], x[rows], self.norm, c.norm_eps)[0].float() if logits else None
        if hidden:
            return scores, add_rms_norm(out[rows], x[rows], self.norm, c.norm_eps)[0].float()
        return scores

    def _cpu_layer_plans(self, kv: KVPool, T: int):
        """Every layer's cpu.LayerPlan (a ctypes array) where one call of the CPU kernels can run the layers of this
        step (fp32 rows on the CPU, few enough for their int8 dot products, pages it reads: _cpu_caches, the
        plain Llama layer with int4/int8 weights); else None, and the layers run op by op."""
        c = self.config
        if (self.device.type != "cpu" or self.dtype != torch.float32 or T >= cpu.GEMM_ROWS or use_triton(kv.k)
                or self._cpu_caches(kv) is None):
            return None
        if not hasattr(self, "_cpu_plans"):
            plain = self.head_cols is None and not c.qk_norm and not c.sandwich_norms
            plans = [cpu.layer_plan([L.qkv, L.o, L.gate_up, L.down], L.attn_norm, L.mlp_norm, c.n_heads,
                                    c.n_kv_heads, c.head_dim, c.act, c.norm_eps) if plain else None
                     for L in self.layers]
            self._cpu_plans = None if None in plans else (cpu.LayerPlan * len(plans))(*plans)
        return self._cpu_plans

    def _cpu_caches(self, kv: KVPool):
        """The layers' cpu.LayerCache array for this pool (its pages, each layer's window and rotation), kept while
        the same pool comes back; None where the CPU kernels do not read its pages (cpu.layer_caches)."""
        kept, key = getattr(self, "_cpu_kept", None), (kv.k.data_ptr(), kv.v.data_ptr())
        if kept is None or kept[0]() is not kv or kept[1] != key:
            c = self.config
            nope, swa = set(c.nope_layers), set(c.swa_layers)
            windows = [c.sliding_window if li in swa else 0 for li in range(c.n_layers)]
            ropes = [2 if li in nope else 1 if li in swa else 0 for li in range(c.n_layers)]
            layers = [kv.layer(i) for i in range(c.n_layers)]
            kept = self._cpu_kept = (weakref.ref(kv), key, cpu.layer_caches(layers, windows, ropes))
        return kept[2]

    def _cpu_layers(self, plans, batch: Batch, kv: KVPool, out: torch.Tensor, rope, local,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's layer loop as one cpu.decode_layers call (the same kernels in the same order): the last
        layer's output and the residual stream."""
        c = self.config
        T = out.shape[0]
        out = out.contiguous()
        x = torch.empty_like(out)
        scratch = (out.new_empty(T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim),
                   out.new_empty(T, c.n_heads * c.head_dim), out.new_empty(T, plans[0].gate_up.N))
        rotations = tuple((cos.contiguous(), sin.contiguous()) for cos, sin in (rope, local))
        cpu.decode_layers(plans, self._cpu_caches(kv), out, x, False, scratch, rotations, kv.page_size, kv.k.shape[1],
                          batch.slots.contiguous(), batch.page_table.contiguous(), batch.seq_lens.contiguous(),
                          batch.q_starts.contiguous(), scale,
                          None if batch.stage_slots is None else batch.stage_slots.contiguous())
        return out, x

    def _body(self):
        linears = [l for L in self.layers for l in (L.qkv, L.o, L.gate_up, L.down)]
        norms = [self.norm] + [t for L in self.layers
                               for t in (L.attn_norm, L.mlp_norm, L.q_norm, L.k_norm, L.attn_out_norm, L.mlp_out_norm)
                               if t is not None]
        return linears, norms

    @functools.cached_property  # the weights are fixed once loaded; every step's cost reads it
    def body_bytes(self) -> int:
        """Bytes every step reads whatever its size: all layers' matrices and norms (not the embedding or head)."""
        linears, norms = self._body()
        return sum(l.nbytes for l in linears) + sum(weight_nbytes(t) for t in norms)

    @functools.cached_property  # the weights are fixed once loaded; every step's cost reads it
    def body_params(self) -> int:
        return sum(l.params for l in self._body()[0])

    @functools.cached_property  # the weights are fixed once loaded; every step's cost reads it
    def embed_row_bytes(self) -> int:
        """Bytes of one token's embedding row (scales included for a quantized embedding)."""
        return weight_nbytes(self.embed) // self.config.vocab_size

    @functools.cached_property  # the weights are fixed once loaded; every step's cost reads it
    def weight_bytes(self) -> int:
        """The bytes of one decode step's weights: the body, the output head and one embedding row."""
        return self.body_bytes + self.head_bytes + self.embed_row_bytes

    @functools.cached_property  # the weights are fixed once loaded; every step's cost reads it
    def head_bytes(self) -> int:
        return self.lm_head.nbytes
