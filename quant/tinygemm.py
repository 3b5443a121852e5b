"""An int4 weight held in the layout of torch's tinygemm kernel (`aten._weight_int4pack_mm`, what gpt-fast runs):
issue 32's per-shape fallback. A model on a GPU holds a matrix so only where kernels/tinygemm.py's measured table
says tinygemm ran that shape faster than localpd's own GEMV on that card.

tinygemm's value of a code q (0..15) is (q - 8) * scale + zero, per group of `group` inputs, scale and zero in the
activations' dtype, stored as scales_zeros [K / group, N, 2]. An Int4Weight's is q * scale + bias, so zero = bias +
8 * scale; both are rounded from float16 to the activations' dtype (bfloat16: 8 significant bits, float16's 11),
so the matrix is the Int4Weight's to about 2**-9 of each group's scale and zero, not to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError
from localpd.quant.weights import Int4Weight

INNER_K_TILES = 8  # the packing's k-tiles a thread loads at once (gpt-fast's choice): K a multiple of 16 x 8
GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes


@dataclass
class TinyGemmInt4:
    packed: torch.Tensor  # the codes in the op's own layout (CUDA: int32 [N / 8, K / 128, 32, 4]; CPU: uint8)
    scales_zeros: torch.Tensor  # [K / group, N, 2] in the activations' dtype
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales_zeros.shape[1], self.scales_zeros.shape[0] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def takes(shape: tuple[int, int], group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's kernel takes a weight of this shape and group with activations of this dtype on this device
    (bfloat16 on CUDA; N a multiple of 8 there, of 16 on the CPU; K a multiple of 128 and of the group)."""
    n, k = shape
    rows = 8 if device.type == "cuda" else 16
    want = torch.bfloat16 if device.type == "cuda" else dtype
    return (dtype == want and dtype in (torch.bfloat16, torch.float16, torch.float32) and group in GROUPS
            and n > 0 and n % rows == 0 and k > 0 and k % (16 * INNER_K_TILES) == 0 and k % group == 0)


def to_tinygemm(w: Int4Weight, dtype: torch.dtype) -> TinyGemmInt4:
    """w in tinygemm's layout on w's device, for activations of `dtype`."""
    device = w.packed.device
    if not takes(w.shape, w.group, dtype, device):
        raise LocalpdError(f"torch's int4 kernel does not take a {w.shape[0]}x{w.shape[1]} int4-g{w.group} weight with "
                           f"{dtype} activations on {device.type}")
    scale = w.scales.float()
    zeros = w.biases.float() + 8 * scale
    scales_zeros = torch.stack((scale, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
    q = w.unpack().to(torch.int32)
    if device.type == "cuda":  # byte b: input 2b in the high nibble, 2b + 1 in the low (torch's own tests' packing)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8),
                                                             INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return TinyGemmInt4(packed, scales_zeros, w.group)


def tinygemm_matmul(x: torch.Tensor, w: TinyGemmInt4) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype, by torch's kernel for the device."""
    op = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    dtype = w.scales_zeros.dtype
    return op(x.to(dtype).contiguous(), w.packed, w.group, w.scales_zeros).to(x.dtype)
