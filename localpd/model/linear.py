"""The model's matrices: y = x @ W.T (+ b) in whatever format a weight is stored, and the format's product found
in one table (KERNELS), so model code never branches on the format and a new format is its file in quant/, its
kernel, and a line here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from localpd.kernels.dispatch import (PreNorm, kmajor_rounding, kstrip_rounding, linear_bnb_int8, linear_bnb_nf4,
                                     linear_codebook, linear_int4, linear_int4k, linear_int5, linear_int8,
                                     linear_kmajor, linear_kstrip, linear_tinygemm)
from localpd.kernels.fused_dispatch import act_mul, add_rms_norm
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight
from localpd.quant.codebook import CODEBOOK_TYPES
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.kmajor import KMajorInt4, KMajorInt8, KStripInt4, KStripInt8
from localpd.quant.tinygemm import TinyGemmInt4
from localpd.quant.weights import Int4Weight, Int8Weight, Weight, cat_rows, weight_nbytes


@dataclass(frozen=True)
class Kernel:
    linear: Callable  # (x, weight, bias, **fused) -> x @ weight.T + bias
    fuses: bool = False  # linear takes gated= (act(gate) * up computed as it loads its input) and norm= (PreNorm)
    # (rows, weight, like) -> the bits linear rounds a plain input to, which a kernel before it may do instead and
    # hand over as rounded= (kernels/act_round.Rounded); None: it never takes rounded=
    rounding: Callable | None = None


DENSE = Kernel(F.linear)
KERNELS: dict[type, Kernel] = {
    Int4Weight: Kernel(linear_int4, fuses=True),
    Int8Weight: Kernel(linear_int8, fuses=True),
    Int4KWeight: Kernel(linear_int4k, fuses=True),
    Int5Weight: Kernel(linear_int5, fuses=True),
    Int5KWeight: Kernel(linear_int5, fuses=True),
    Int6KWeight: Kernel(linear_int5, fuses=True),
    Int3KWeight: Kernel(linear_int5, fuses=True),
    Int2KWeight: Kernel(linear_int5, fuses=True),
    **{cls: Kernel(linear_codebook, fuses=True) for cls in set(CODEBOOK_TYPES.values())},
    KMajorInt4: Kernel(linear_kmajor, fuses=True, rounding=kmajor_rounding),  # the GPU's layout of the two above
    KMajorInt8: Kernel(linear_kmajor, fuses=True, rounding=kmajor_rounding),  # (to_gpu_layout)
    KStripInt4: Kernel(linear_kstrip, fuses=True, rounding=kstrip_rounding),  # the same in strips of 4 outputs
    KStripInt8: Kernel(linear_kstrip, fuses=True, rounding=kstrip_rounding),
    TinyGemmInt4: Kernel(linear_tinygemm, fuses=True),  # torch's int4 kernel where measured faster (kernels/tinygemm.py)
    Nf4Weight: Kernel(linear_bnb_nf4),
    BnbInt8Weight: Kernel(linear_bnb_int8),
}


class QuantLinear:
    """y = x @ W.T (+ b) for a dense, int8, int4 or bitsandbytes weight: the one place model code touches a weight
    matrix, so the model never branches on the format."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    @property
    def kernel(self) -> Kernel:
        return KERNELS.get(type(self.weight), DENSE)

    def __call__(self, x: torch.Tensor, rounded=None) -> torch.Tensor:
        """rounded: x already rounded for this product's integer GEMV (input_rounding)."""
        if rounded is not None:
            return self.kernel.linear(x, self.weight, self.bias, rounded=rounded)
        return self.kernel.linear(x, self.weight, self.bias)

    def input_rounding(self, rows: int, like: torch.Tensor) -> int:
        """The bits (4 or 8) this product rounds a plain input of `rows` rows (like's device and dtype) to for its
        integer GEMV, where the kernel that makes the input may round it instead and pass it as rounded=; else 0."""
        rounding = self.kernel.rounding
        return rounding(rows, self.weight, like) if rounding else 0

    def gated(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up) for gate_up = [gate | up]: the int4/int8 GEMVs compute the activation as they
        load it, so a decode step launches no kernel of its own for it."""
        kernel = self.kernel
        if kernel.fuses:
            return kernel.linear(gate_up, self.weight, self.bias, gated=act)
        return self(act_mul(gate_up, act))

    def normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(RMSNorm(s) * norm_weight), s) for s = x + residual (x without one): the int4/int8 GEMVs
        normalise their input as they load it, so a decode step launches no norm kernel of its own."""
        kernel = self.kernel
        if kernel.fuses:
            return kernel.linear(x, self.weight, self.bias, norm=PreNorm(residual, norm_weight, eps))
        return normed_separately(self, x, residual, norm_weight, eps)

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

    def normed(self, x, residual, norm_weight, eps):
        return normed_separately(self, x, residual, norm_weight, eps)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts)


def normed_separately(linear, x, residual, norm_weight, eps):
    """QuantLinear.normed with the residual add and RMSNorm in a kernel of their own (add_rms_norm)."""
    h, s = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h), s


def fuse(parts: list[QuantLinear]) -> QuantLinear | StackedLinear:
    """One matrix for projections that read the same input (q/k/v, gate/up): one launch instead of several."""
    weights = [p.weight for p in parts]
    kinds = {(type(w), getattr(w, "group", None), getattr(w, "dtype", None)) for w in weights}
    if len(kinds) > 1:
        return StackedLinear(parts)
    biases = [p.bias for p in parts]
    bias = None if any(b is None for b in biases) else torch.cat(biases)
    return QuantLinear(cat_rows(weights), bias)
