"""Cross-check the per-step byte accounting against Nsight Compute: one batch-1 decode step of a synthetic model,
profiled for DRAM bytes read and written by every kernel (caches flushed before each, ncu's default), summed,
beside localpd.measure.roofline.step_cost for the same step. Issue 5 asks for agreement within 10%.

On the GPU machine:
    ncu --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv \\
        --log-file $OUT/ncu.csv python3 scripts/ncu_step_bytes.py run --json $OUT/step.json
    python3 scripts/ncu_step_bytes.py compare $OUT/ncu.csv $OUT/step.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def run(args) -> int:
    import torch

    from localpd.model.transformer import Batch, Transformer
    from localpd.kvcache.formats import KVTraffic, new_kv_pool
    from localpd.measure.roofline import step_cost
    from localpd.load.synthetic import synthetic_model

    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    loaded = synthetic_model(args.model, args.quant, torch.bfloat16, dev)
    model = Transformer(loaded.config, loaded.weights)
    c, ps = model.config, 16
    n_pages = -(-(args.context + 1) // ps)
    pool = new_kv_pool(args.kv, c.n_layers, n_pages, ps, c.n_kv_heads, c.head_dim, model.dtype, dev)
    prompt = torch.randint(0, c.vocab_size, (args.context,)).tolist()
    model.forward(Batch.single(prompt, 0, n_pages, ps, dev), pool)
    step = Batch.single([1], args.context, n_pages, ps, dev)
    model.forward(step, pool)  # compiled and warm; the profiled step rewrites the same slot
    if gpu:  # --device cpu is a dry run of the script itself
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model.forward(step, pool)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    traffic = KVTraffic(args.kv, c.n_layers, c.n_kv_heads, c.head_dim, ps, model.dtype.itemsize)
    cost = step_cost(model, [(args.context, 1)], traffic, 1)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "quant": args.quant, "kv": args.kv, "context": args.context,
                   "weight_bytes": cost.weight_bytes, "kv_read_bytes": cost.kv_read_bytes,
                   "kv_write_bytes": cost.kv_write_bytes, "bytes": cost.bytes}, f)
    return 0


def compare(args) -> int:
    with open(args.ncu) as f:
        lines = [line for line in f if line.startswith('"')]
    read = write = 0.0
    kernels = set()
    for row in csv.DictReader(lines):
        value = float(row["Metric Value"].replace(",", "")) * UNITS.get(row["Metric Unit"], 1)
        kernels.add(row["ID"])
        if row["Metric Name"] == "dram__bytes_read.sum":
            read += value
        elif row["Metric Name"] == "dram__bytes_write.sum":
            write += value
    with open(args.step) as f:
        step = json.load(f)
    ours = step["bytes"]
    print(f"{step['model']} {step['quant']} kv {step['kv']} context {step['context']}: {len(kernels)} kernels")
    print(f"  ncu DRAM read {read / 1e6:.1f} MB + write {write / 1e6:.1f} MB = {(read + write) / 1e6:.1f} MB")
    print(f"  accounting {ours / 1e6:.1f} MB (weights {step['weight_bytes'] / 1e6:.1f}, KV read "
          f"{step['kv_read_bytes'] / 1e6:.1f}, KV write {step['kv_write_bytes'] / 1e6:.3f})")
    ratio = (read + write) / ours
    print(f"  ncu / accounting = {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.10 else 'outside'} 10%)")
    return 0 if abs(ratio - 1) <= 0.10 else 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="llama3.2-1b")
    r.add_argument("--quant", default="int4-g128")
    r.add_argument("--kv", default="bf16")
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--json", required=True)
    r.add_argument("--device", default="cuda")
    cmp = sub.add_parser("compare")
    cmp.add_argument("ncu")
    cmp.add_argument("step")
    args = p.parse_args()
    return run(args) if args.cmd == "run" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
