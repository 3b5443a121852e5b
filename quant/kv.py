"""Paged KV-cache storage: per-layer pages of keys and values, stored as is (fp32/fp16/bf16) or quantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError

KV_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "fp8")
FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class KVLayer:
    k: torch.Tensor  # [n_pages, page_size, n_kv_heads, packed_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_zero: torch.Tensor | None
    kv_dtype: str
    page_size: int
    compute_dtype: torch.dtype


@dataclass
class KVPool:
    kv_dtype: str
    page_size: int
    k: torch.Tensor  # [n_layers, n_pages, page_size, n_kv_heads, packed_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    v_zero: torch.Tensor | None
    compute_dtype: torch.dtype

    def layer(self, i: int) -> KVLayer:
        def pick(t):
            return None if t is None else t[i]

        return KVLayer(self.k[i], self.v[i], pick(self.k_scale), pick(self.v_scale), pick(self.k_zero),
                       pick(self.v_zero), self.kv_dtype, self.page_size, self.compute_dtype)


def check_kv_dtype(kv_dtype: str, device) -> str:
    if kv_dtype not in KV_DTYPES:
        raise LocalpdError(f"unknown KV dtype '{kv_dtype}'; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype not in FLOAT:
        raise LocalpdError(f"KV dtype '{kv_dtype}' is not available yet")
    return kv_dtype


def kv_bytes_per_token(kv_dtype: str, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * FLOAT[kv_dtype].itemsize


def new_kv_pool(kv_dtype, n_layers, n_pages, page_size, n_kv_heads, head_dim, compute_dtype, device) -> KVPool:
    shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
    dt = FLOAT[kv_dtype]
    return KVPool(kv_dtype, page_size, torch.zeros(shape, dtype=dt, device=device),
                  torch.zeros(shape, dtype=dt, device=device), None, None, None, None, compute_dtype)
