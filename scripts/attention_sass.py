"""What the attention kernels compile to, without a GPU: kvcache.dispatch.paged_attention is called on CPU tensors
shaped like a real model's cache, its decode_kernel (or prefill_kernel) launch is captured instead of run, and that
launch is compiled for an NVIDIA architecture (scripts/sass.py). Per KV dtype it reports the main loop's SASS
instructions per 4-byte word of keys, values, scales and zeros a thread streams, barriers, shared-memory
instructions, global load instructions, the widest load, registers and spilled bytes, beside each card's
instruction budget, and the global loads a loop trip waits on itself (measure/sass.in_trip_loads: loads whose
value the same trip reads, and the round trips they cost it in turn; the pipeliner's asynchronous copies and loads
made a trip ahead are not among them).

    python scripts/attention_sass.py                          # sm_90, Llama-3-8B heads (8 KV x 128, GQA 4)
    python scripts/attention_sass.py --arch 89 --heads 32,4,64 --kv bf16,int8
    python scripts/attention_sass.py --kernel prefill      # a 512-token chunk after 3,584 cached tokens
"""

from __future__ import annotations

import argparse

import triton

import localpd.kernels.paged_attention as kernels
from localpd.kvcache.dispatch import decode_block_t
from localpd.kvcache.formats import KV_DTYPES, kv_bytes_per_token, kv_formats
from localpd.measure.predict_attention import PAGE_SIZE, attention_launch
from sass import compile_launch, cuobjdump, in_trip_loads, loop_body, loop_stats, print_budgets  # this folder's


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
          f"{'widest':>20} {'regs':>4} {'spill':>5} {'waited':>6} {'trips':>5}")
    for arch in map(int, args.arch.split(",")):
        for kv_dtype in args.kv.split(","):
            launch_args, kwargs = attention_launch(kernel_name, kv_dtype, n_heads, n_kv_heads, head_dim, arch=arch)
            kernel = compile_launch(getattr(kernels, kernel_name), launch_args, kwargs, arch)
            tile_bytes = trip(kv_dtype) * kv_bytes_per_token(kv_dtype, 1, 1, head_dim, PAGE_SIZE)
            s = loop_stats(kernel, tile_bytes / 4 / (32 * kwargs["num_warps"]))
            waited, trips = in_trip_loads(loop_body(cuobjdump(kernel.asm["cubin"])))
            print(f"{arch:>5} {kv_dtype:>12} {s.instructions:>6} {s.per_word:>10} {s.barriers:>4} {s.shared:>5} "
                  f"{s.global_loads:>5} {s.widest_load:>20} {s.registers:>4} {s.spilled:>5} {waited:>6} {trips:>5}")
    print_budgets()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
