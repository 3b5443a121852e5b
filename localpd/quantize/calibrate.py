"""Activation importance for quantization: the mean square of the activations entering each weight matrix's input
columns, measured by running a short calibration text through the model (llama.cpp's importance matrix).

A column whose activations are large carries more of the output, so int4 quantization (Int4Weight.quantize) weighs
its rounding error more. The default text is localpd/quantize/calibration.txt: prose, dialogue, instructions, a recipe,
code and arithmetic, written for this purpose (never the text perplexity is measured on).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

import torch

from localpd.errors import LocalpdError
from localpd.kernels.fused_dispatch import act_mul
from localpd.model.linear import normed_separately
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool, same_kv

PAGE_SIZE, CHUNK = 16, 512
# the model's fused projections -> the weight matrices that read the same input
INPUTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def default_text() -> str:
    return resources.files("localpd.quantize").joinpath("calibration.txt").read_text(encoding="utf-8")


@dataclass
class Calibration:
    importance: dict[str, torch.Tensor]  # weight name (layers.i.q_proj ...) -> float32 [K] on the CPU
    tokens: int
    text_sha256: str


class _Recorder:
    """Stands in for one projection during calibration: sums the squares of its input columns."""

    def __init__(self, linear):
        self.linear, self.sum_sq, self.rows = linear, None, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sq = (x.float() ** 2).sum(0)
        self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        self.rows += x.shape[0]
        return self.linear(x)

    def gated(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """The down projection's call (QuantLinear.gated): its input is act(gate) * up."""
        return self(act_mul(gate_up, act))

    def normed(self, x, residual, norm_weight, eps):
        """The call of a projection after a norm (QuantLinear.normed): its input is the normalised sum."""
        return normed_separately(self, x, residual, norm_weight, eps)


def calibrate(model: Transformer, ids: list[int], text_sha256: str = "") -> Calibration:
    """Run ids (one sequence, at most the model's context) through the model and return each projection's
    input importance. The model is left as it was."""
    if len(ids) < 2:
        raise LocalpdError("the calibration text has fewer than 2 tokens")
    c = model.config
    ids = ids[:c.max_context]
    n_pages = -(-len(ids) // PAGE_SIZE)
    kv = new_kv_pool(same_kv(model.dtype), c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, model.dtype,
                     model.device)
    recorders = {}
    for i, layer in enumerate(model.layers):
        for attr in INPUTS:
            recorders[i, attr] = _Recorder(getattr(layer, attr))
            setattr(layer, attr, recorders[i, attr])
    try:
        for start in range(0, len(ids), CHUNK):
            model.forward(Batch.single(ids[start:start + CHUNK], start, n_pages, PAGE_SIZE, model.device), kv)
    finally:
        for (i, attr), r in recorders.items():
            setattr(model.layers[i], attr, r.linear)
    importance = {}
    for (i, attr), r in recorders.items():
        mean_sq = (r.sum_sq / r.rows).cpu()
        for name in INPUTS[attr]:
            importance[f"layers.{i}.{name}"] = mean_sq
    return Calibration(importance, len(ids), text_sha256)


def calibrate_text(model: Transformer, tokenizer, text: str | None = None) -> Calibration:
    text = default_text() if text is None else text
    return calibrate(model, tokenizer.encode(text), hashlib.sha256(text.encode()).hexdigest())
