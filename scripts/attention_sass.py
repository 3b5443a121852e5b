"""What the attention kernels compile to, without a GPU: kvcache.dispatch.paged_attention is called on CPU tensors
shaped like a real model's cache, its decode_kernel (or prefill_kernel) launch is captured instead of run, and that
launch is compiled for an NVIDIA architecture (scripts/sass.py). Per KV dtype it reports the main loop's SASS
instructions per 4-byte word of keys, values, scales and zeros a thread streams, barriers, shared-memory
instructions, global load instructions, the widest load, registers and spilled bytes, beside each card's
instruction budget.

    python scripts/attention_sass.py                          # sm_90, Llama-3-8B heads (8 KV x 128, GQA 4)
    python scripts/attention_sass.py --arch 89 --heads 32,4,64 --kv bf16,int8
    python scripts/attention_sass.py --kernel prefill      # a 512-token chunk after 3,584 cached tokens
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

import localpd.kernels.paged_attention as kernels
import localpd.kvcache.dispatch as kv_dispatch
from localpd.kvcache.dispatch import decode_block_t, paged_attention
from localpd.kvcache.formats import KV_DTYPES, kv_bytes_per_token, kv_formats, new_kv_pool
from sass import compile_launch, loop_stats, print_budgets  # this script's folder

PAGE_SIZE = 16


class Captured(Exception):
    pass


def attention_launch(kernel: str, kv_dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, context: int = 4096,
                     chunk: int = 512):
    """(args, kwargs) of the `kernel` launch ("decode_kernel" or "prefill_kernel") paged_attention makes for one
    bf16 sequence of `context` tokens: one query row (decode) or its last `chunk` tokens (prefill)."""
    pages = context // PAGE_SIZE
    rows = 1 if kernel == "decode_kernel" else chunk
    layer = new_kv_pool(kv_dtype, 1, pages, PAGE_SIZE, n_kv_heads, head_dim, torch.bfloat16, "cpu").layer(0)
    q = torch.zeros(rows, n_heads, head_dim, dtype=torch.bfloat16)
    table = torch.arange(pages, dtype=torch.int32)[None]
    lens, starts = torch.tensor([context], dtype=torch.int32), torch.tensor([0, rows], dtype=torch.int32)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise Captured(args, kwargs)
            return launch

    real, gpu_dot = getattr(kernels, kernel), kv_dispatch.attention_dot
    setattr(kernels, kernel, Recorder())
    kv_dispatch.attention_dot = lambda dtype, interpreted: gpu_dot(dtype, interpreted=False)  # a GPU's dot type
    os.environ["LOCALPD_TRITON_INTERPRET"] = "1"  # Triton's path on CPU tensors (the launch never runs)
    try:
        paged_attention(q, layer, table, lens, starts, head_dim ** -0.5)
    except Captured as e:
        return e.args
    finally:
        setattr(kernels, kernel, real)
        kv_dispatch.attention_dot = gpu_dot
    raise RuntimeError(f"paged_attention did not launch {kernel}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="compute capabilities, e.g. 90,89,86")
    p.add_argument("--kv", default=",".join(KV_DTYPES))
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--kernel", choices=("decode", "prefill"), default="decode")
    args = p.parse_args()
    n_heads, n_kv_heads, head_dim = map(int, args.heads.split(","))
    kernel_name = f"{args.kernel}_kernel"
    def trip(kv_dtype: str) -> int:  # tokens a loop trip takes
        return decode_block_t(PAGE_SIZE, head_dim, kv_formats(kv_dtype)[0]) if args.kernel == "decode" else PAGE_SIZE
    print(f"# Triton {triton.__version__}; {kernel_name}, {n_heads} query / {n_kv_heads} KV heads x {head_dim}; per "
          f"loop trip ({trip('bf16')} tokens over 16-bit keys, {trip('int8')} over rounded ones): SASS instructions "
          f"per 4-byte word of KV a thread streams, barriers, shared-memory and global load instructions, widest load")
    print(f"{'arch':>5} {'kv':>12} {'instr':>6} {'instr/word':>10} {'bar':>4} {'smem':>5} {'loads':>5} "
          f"{'widest':>20} {'regs':>4} {'spill':>5}")
    for arch in map(int, args.arch.split(",")):
        for kv_dtype in args.kv.split(","):
            launch_args, kwargs = attention_launch(kernel_name, kv_dtype, n_heads, n_kv_heads, head_dim)
            kernel = compile_launch(getattr(kernels, kernel_name), launch_args, kwargs, arch)
            tile_bytes = trip(kv_dtype) * kv_bytes_per_token(kv_dtype, 1, 1, head_dim, PAGE_SIZE)
            s = loop_stats(kernel, tile_bytes / 4 / (32 * kwargs["num_warps"]))
            print(f"{arch:>5} {kv_dtype:>12} {s.instructions:>6} {s.per_word:>10} {s.barriers:>4} {s.shared:>5} "
                  f"{s.global_loads:>5} {s.widest_load:>20} {s.registers:>4} {s.spilled:>5}")
    print_budgets()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
