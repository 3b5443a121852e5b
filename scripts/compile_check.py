"""Every Triton kernel launch the model makes, compiled for the cards we target, without a GPU.

A kernel that compiles for the H100 can still fail on a desktop card: Triton raises OutOfResources at the launch
when a program needs more shared memory than the card gives a block (99 KB on sm_86/89/120, 163 KB on sm_80,
227 KB on sm_90). This script finds such launches, compile errors and register spills before any GPU sees them:

1. record: a process with Triton's interpreter switched on runs the model's steps (the head layouts of
   Llama-3-8B, Qwen2.5-7B, Llama-3.2-1B, SmolLM2, Qwen3-8B, Gemma 3 1B/4B and Phi-3.5-mini (heads of 96 in
   tiles of 128, no query groups) with fewer heads and narrow widths of the same divisibility, one layer) through a
   prefill, a prefill after a cached prefix mixed with a decode, and decode
   batches of 1-9 sequences, in bf16 with every KV format and weight scheme; each kernel launch is recorded as
   Triton's launcher would specialise it (argument types, 16-divisible pointers and integers, constexprs) and
   not run: which kernels launch, and how, depends on shapes, never on values. Splits are chosen as for an
   H100's 132 SMs. The autotuned GEMV is kept once per combination of its constexprs and expanded to every
   candidate GEMV_CONFIGS keeps for its rows (gemv_tile_fits), the first also with split-K.
2. compile: each distinct launch is compiled for each architecture (scripts/sass.py) and its registers, spilled
   bytes (and the local accesses a loop makes to them) and shared memory are printed against the architecture's
   per-block limit.

    python scripts/compile_check.py                      # sm_86, 89, 90, 120; exit 1 on any failure
    python scripts/compile_check.py --arch 86 --kernels prefill --strict   # only those; a spill a loop reloads fails too
    PYTHONPATH=/tmp/t36 python scripts/compile_check.py --arch 86    # under another Triton (the device's 3.6)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
# the most shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 120: 99 * 1024}
# (synthetic model, query heads, KV heads, hidden size, MLP width): the model's head size and query group, fewer
# heads, narrow widths; every size keeps its divisibility by 16 (and its int4 words per row by 4), and no count
# becomes 1, so each launch specialises as at full size
MODELS = [("llama3-8b", 8, 2, 256, 512), ("qwen2.5-7b", 14, 2, 256, 640), ("llama3.2-1b", 8, 2, 256, 512),
          ("smollm2-135m", 6, 2, 192, 384), ("qwen3-8b", 8, 2, 256, 512), ("gemma3-1b", 8, 2, 256, 512),
          ("gemma3-4b", 4, 2, 256, 512), ("phi3.5-mini", 8, 8, 256, 512)]
SCHEMES = ("int4-g128", "int4-g32", "int8")
KV = ("bf16", "int8", "int4", "fp8", "int8/int4", "int4ch/int4")
PAGE = 16


def record(out: str, kernels: str = "") -> None:
    """Run the model on the interpreter and write each distinct launch to `out` (JSON lines); where `kernels` (the
    --kernels pattern) takes the K-major GEMV, again with the int4/int8 matrices in the GPU's K-major layout."""
    os.environ["LOCALPD_TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton.language as tl
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.interpreter import InterpretedFunction

    from localpd.model.config import ModelConfig
    from localpd.model.transformer import Batch, Transformer
    from localpd.kvcache.formats import new_kv_pool
    from localpd.load.synthetic import SYNTHETIC, synthetic_model

    seen: dict[str, dict] = {}

    def describe(value, constexpr: bool):
        """A constexpr's value; else the type and specialisation the launcher gives the argument (an integer 1
        becomes a constexpr)."""
        if isinstance(value, tl.dtype):  # a constexpr naming a type (the attention's DOT)
            return {"dtype": value.name}
        if constexpr:
            return {"value": value}
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        return {"value": value} if ty == "constexpr" else {"type": ty, "spec": spec}

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        values = args + tuple(kwargs[n] for n in list(params)[len(args):])
        launch = {"kernel": f"{self.fn.__module__}:{self.fn.__name__}",
                  "args": {n: describe(v, "constexpr" in str(params[n].annotation)) for n, v in zip(params, values)},
                  "options": {o: kwargs[o] for o in ("num_warps", "num_stages") if o in kwargs}}
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)  # and not run: no launch depends on values

    InterpretedFunction.run = recording_run
    # the splits a GPU takes (decode attention across pages, the GEMV across K), as on an H100's 132 SMs
    import localpd.kernels.gemv_dp4a as gemv_dp4a
    import localpd.kernels.gemv_kmajor as gemv_kmajor
    import localpd.kvcache.dispatch as kv_dispatch
    import localpd.kernels.quant_matmul as quant_matmul

    cpu_splits = kv_dispatch.decode_splits
    kv_dispatch.sm_count = quant_matmul.sm_count = gemv_kmajor.sm_count = lambda device: 132
    gemv_dp4a._asm = lambda device: True  # the GPU's dp4a instruction (launches are recorded, not run)
    kv_dispatch.decode_splits = lambda heads, tiles, device: cpu_splits(heads, tiles, torch.device("cuda"))
    gpu_dot = kv_dispatch.attention_dot
    kv_dispatch.attention_dot = lambda dtype, interpreted: gpu_dot(dtype, interpreted=False)  # bf16 dots, as a GPU
    dtype = torch.bfloat16
    for name, heads, kv_heads, dim, hidden in MODELS:
        real = SYNTHETIC[name]
        SYNTHETIC[name] = ModelConfig(**{**real.__dict__, "vocab_size": 384, "dim": dim, "n_layers": 1,
                                         "n_heads": heads, "n_kv_heads": kv_heads, "ffn_dim": hidden})
        for scheme, kv_dtype in [(s, "bf16") for s in SCHEMES] + [("int4-g128", kv) for kv in KV[1:]]:
            loaded = synthetic_model(name, scheme, dtype, "cpu")
            model = Transformer(loaded.config, loaded.weights)
            for fused in (True, False) if kv_dtype == "bf16" else (True,):
                model.fused = fused
                run_steps(model, kv_dtype, Batch, new_kv_pool, torch)
            if kv_dtype == "bf16" and scheme.startswith("int") and re.search(kernels, "_gemv_(kmajor|dp4a)_kernel|_quantize_act_kernel"):
                model.fused = True
                model._to_gpu_layout()  # what a GPU runs (quant/kmajor.py)
                run_steps(model, kv_dtype, Batch, new_kv_pool, torch)
            print(f"# recorded {name} {scheme} {kv_dtype}: {len(seen)} distinct launches", file=sys.stderr, flush=True)
        SYNTHETIC[name] = real
    with open(out, "w") as f:
        for launch in seen.values():
            f.write(json.dumps(launch) + "\n")


def run_steps(model, kv_dtype, Batch, new_kv_pool, torch) -> None:
    """A 40-token prefill; a 20-token chunk after 16 cached tokens beside a decode; decode steps of 1, 2, 3, 5 and
    9 sequences (GEMV rows 1, 2, 4, 8, and the GEMM) at contexts from 3 to 130 tokens. Page tables are as wide as
    an 8k context, as the CUDA graphs have them, so decode attention takes its widest splits."""
    c = model.config
    seqs = 9
    pages_per_seq = 8192 // PAGE
    pool = new_kv_pool(kv_dtype, c.n_layers, seqs * pages_per_seq, PAGE, c.n_kv_heads, c.head_dim, model.dtype,
                       "cpu", stage_rows=seqs)
    g = torch.Generator().manual_seed(0)

    def step(work):  # work: (sequence, tokens cached, tokens new)
        ids, pos, slots, stage, starts, lens, rows = [], [], [], [], [0], [], []
        for s, start, n in work:
            ids += torch.randint(0, c.vocab_size, (n,), generator=g).tolist()
            pos += range(start, start + n)
            slots += [s * pages_per_seq * PAGE + p for p in range(start, start + n)]
            stage += [s * PAGE + p % PAGE for p in range(start, start + n)]
            starts.append(starts[-1] + n)
            lens.append(start + n)
            rows.append(starts[-1] - 1)
        table = [[s * pages_per_seq + i for i in range(pages_per_seq)] for s, _, _ in work]
        t = torch.tensor
        model.forward(Batch(t(ids), t(pos), t(slots), t(table, dtype=torch.int32), t(lens, dtype=torch.int32),
                            t(starts, dtype=torch.int32), t(rows), t(stage) if pool.has_stage else None), pool)

    step([(0, 0, 40)])
    step([(0, 40, 1), (1, 0, 16)])
    step([(1, 16, 20), (0, 41, 1)])
    for b in (1, 2, 3, 5, 9):
        step([(s, 130 if s == 0 else 3 * s, 1) for s in range(b)])


def compile_one(job):
    """(kernel, constexprs shown, options, arch, registers, spilled bytes, local accesses in loops, shared bytes,
    error or '')"""
    launch, arch = job
    import importlib

    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from sass import cuobjdump, local_in_loops  # this script's folder

    module, name = launch["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    if "PAIRS" in launch["args"]:  # the prefill kernel's byte pairs: what this card takes, not the recording's
        from localpd.kvcache.dispatch import prefill_value_pairs

        launch = {**launch, "args": {**launch["args"], "PAIRS": {**launch["args"]["PAIRS"],
                                                                 "value": prefill_value_pairs(arch)}}}
    sig, const, attrs = {}, {}, {}
    for i, (param, (arg, d)) in enumerate(zip(kernel.params, launch["args"].items())):
        if "dtype" in d:
            sig[arg], const[arg] = "constexpr", triton.language.dtype(d["dtype"])
            continue
        ty, spec = (d["type"], d["spec"]) if "type" in d else \
            ("constexpr", None) if param.is_constexpr else native_specialize_impl(BaseBackend, d["value"], False,
                                                                                  True, True)
        if ty == "constexpr":
            sig[arg], const[arg] = "constexpr", d["value"]
        else:
            sig[arg] = ty
            if spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    shown = ",".join(f"{k}={v}" for k, v in const.items() if k[0].isupper() and v not in (None, False))
    try:
        compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=launch["options"])
    except Exception as e:  # noqa: BLE001 - every failure is a finding to print
        return name, shown, launch["options"], arch, None, None, None, None, f"{type(e).__name__}: {str(e)[:300]}"
    usage = cuobjdump(compiled.asm["cubin"])
    regs, stack = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
    return name, shown, launch["options"], arch, regs, stack, local_in_loops(usage), compiled.metadata.shared, ""


def fp8(launch) -> bool:
    """Whether the launch takes float8 e4m3 tensors (--kv fp8), which localpd offers on sm_89 and newer only."""
    return any("fp8" in d.get("type", "") for d in launch["args"].values())


GEMV_KEY = ("BITS", "GROUP", "HAS_BIAS", "BLOCK_M", "GATED", "NORM", "HAS_RES", "OUT_BIAS")


def gemv_launches(launches):
    """One GEMV launch per combination of its constexprs (the one with the most 16-divisible arguments),
    expanded to the autotuned GEMV as the GPU runs it: each candidate that fits its rows, and the first of them
    with split-K too."""
    from localpd.kernels.dispatch import GEMV_CONFIGS, gemv_tile_fits

    best = {}
    for launch in launches:
        a = launch["args"]
        key = tuple(a[k]["value"] for k in GEMV_KEY)
        aligned = sum(d.get("spec") == "D" for d in a.values())
        if key not in best or aligned > best[key][0]:
            best[key] = aligned, launch
    for _, launch in best.values():
        a = launch["args"]
        fits = [c for c in GEMV_CONFIGS if gemv_tile_fits(a["BLOCK_M"]["value"], c[0], c[1], a["BITS"]["value"], c[2])]
        for i, (bn, bk, warps, stages) in enumerate(fits):
            for split in (1, 3) if i == 0 else (1,):
                args = {**a, "BLOCK_N": {"value": bn}, "BLOCK_K": {"value": bk}, "ATOMIC": {"value": split > 1},
                        "SPLIT_K": {"value": split} if split == 1 else {"type": "i32", "spec": ""}}
                yield {**launch, "args": args, "options": {"num_warps": warps, "num_stages": stages}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="86,89,90,120", help="compute capabilities, e.g. 86,90")
    p.add_argument("--launches", help="record the launches into this file, or reuse it where it exists")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--kernels", default="", help="only kernels whose name matches this regular expression")
    p.add_argument("--strict", action="store_true",
                   help="a spill a loop reloads fails too (one stored before the loops and reloaded after them, "
                        "two accesses a program, is printed and passes)")
    args = p.parse_args()
    path = args.launches or tempfile.mkstemp(suffix=".jsonl")[1]
    if not args.launches or not os.path.exists(path):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # record on the installed Triton
        subprocess.run([sys.executable, __file__, "--record", path, args.kernels], check=True, env=env)
    launches = [json.loads(line) for line in open(path)]
    if not args.launches:
        os.remove(path)
    gemv = [launch for launch in launches if launch["kernel"].endswith(":_gemv_kernel")]
    archs = list(map(int, args.arch.split(",")))
    jobs = [(launch, arch) for launch in [*(x for x in launches if x not in gemv), *gemv_launches(gemv)]
            for arch in archs if re.search(args.kernels, launch["kernel"]) and (arch >= 89 or not fp8(launch))]
    import triton

    print(f"# Triton {triton.__version__}: {len(launches)} recorded launches, {len(jobs)} compilations")
    failed = spills = 0
    rows = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, shown, options, arch, regs, spill, looped, shared, error in pool.map(compile_one, jobs,
                                                                                        chunksize=4):
            limit = SHARED_LIMIT.get(arch)
            bad = error or (shared is not None and limit and shared > limit)
            failed += bool(bad)
            spills += bool(looped)
            key = (name, shown, json.dumps(options))
            rows.setdefault(key, {})[arch] = error or f"{regs}r {spill}B-spill" + \
                (f" ({looped} in loops)" if spill else "") + f" {shared / 1024:.1f}KB" + (" OVER" if bad else "")
    for (name, shown, options), by_arch in sorted(rows.items()):
        cells = " | ".join(f"sm_{a}: {by_arch.get(a, '-')}" for a in archs)
        print(f"{name} {shown} {options}: {cells}")
    print(f"# {failed} failed or over a shared-memory limit; {spills} spill registers that a loop reloads")
    return 1 if failed or (args.strict and spills) else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if sys.argv[1:2] == ["--record"]:
        sys.exit(record(sys.argv[2], *sys.argv[3:4]))
    sys.exit(main())
