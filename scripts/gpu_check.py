"""Model-level check on a GPU: the same random weights run on the CPU (torch references) and on the GPU (Triton
kernels), a prompt chunk then decode steps through the paged cache, every weight scheme and KV dtype; prints
the relative error of the logits per step. float32 activations on both sides should agree to ~1e-5; bf16 on
the GPU against float32 on the CPU to ~1e-2. Usage: python scripts/gpu_check.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys

import torch

import localpd.model.transformer as model_module
from localpd.kernels.fused_dispatch import rope_ref
from localpd.kvcache.dispatch import write_kv_ref
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool
from localpd.quant.weights import Int4Weight, Int8Weight
from localpd.load.synthetic import synthetic_model

PS = 16
rope_write_kv = model_module.rope_write_kv


def torch_rope_write_kv(qkv, cos, sin, layer, slots, n_heads, n_kv_heads, stage_slots=None):
    """The model's RoPE + KV write with torch references only (no Triton): rope_ref, then write_kv_ref."""
    heads = qkv.view(qkv.shape[0], n_heads + 2 * n_kv_heads, -1)
    rope_ref(heads[:, :n_heads + n_kv_heads], cos, sin)
    write_kv_ref(layer, heads[:, n_heads:n_heads + n_kv_heads], heads[:, n_heads + n_kv_heads:], slots, stage_slots)
    return heads[:, :n_heads]

def to_device(w, device):
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed.to(device), w.scales.to(device), w.biases.to(device))
    if isinstance(w, Int8Weight):
        return Int8Weight(w.data.to(device), w.scales.to(device))
    return w.to(device)


def run(model: Transformer, kv_dtype: str, prompt: list[int], decode: list[int], device) -> list[torch.Tensor]:
    c = model.config
    n_pages = -(-(len(prompt) + len(decode)) // PS) + 1
    pool = new_kv_pool(kv_dtype, c.n_layers, n_pages, PS, c.n_kv_heads, c.head_dim, model.dtype, device)
    out = [model.forward(Batch.single(prompt, 0, n_pages, PS, device), pool)]
    for i, t in enumerate(decode):
        out.append(model.forward(Batch.single([t], len(prompt) + i, n_pages, PS, device), pool))
    return [o.float().cpu() for o in out]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--graphs-only", action="store_true")
    args = p.parse_args()
    if args.graphs_only:
        return 0 if graphs_match_eager() else 1
    g = torch.Generator().manual_seed(0)
    failures = 0
    for scheme in ("fp32", "int8", "int4-g32"):
        loaded = synthetic_model(args.model, scheme, torch.float32, "cpu")
        vocab = loaded.config.vocab_size
        prompt = torch.randint(0, vocab, (37,), generator=g).tolist()
        decode = torch.randint(0, vocab, (4,), generator=g).tolist()
        cpu = Transformer(loaded.config, loaded.weights)
        for compute in (torch.float32, torch.bfloat16):
            gpu_w = {k: to_device(v, "cuda") for k, v in loaded.weights.items()}
            if compute != torch.float32:
                gpu_w = {k: v.to(compute) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                         for k, v in gpu_w.items()}
            gpu = Transformer(loaded.config, gpu_w)
            kvs = (("fp32", "int8", "int4", "int4+torch-write", "fp8", "int8/int4", "int4ch/int4")
                   if compute == torch.float32 else ("bf16", "int8", "int4", "int8/int4", "int4ch/int4"))
            for kv in kvs:
                ref_kv = "fp32" if kv == "bf16" else kv.split("+")[0]
                ref = run(cpu, ref_kv, prompt, decode, "cpu")
                if kv.endswith("+torch-write"):  # which half of the GPU path is at fault, if any
                    model_module.rope_write_kv = torch_rope_write_kv
                got = run(gpu, kv.split("+")[0], prompt, decode, "cuda")
                model_module.rope_write_kv = rope_write_kv
                errs = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
                tol = (2e-3 if kv in ("fp32", "bf16") else 3e-2) if compute == torch.float32 else 5e-2
                ok = all(e < tol for e in errs) and all(torch.isfinite(a).all() for a in got)
                failures += not ok
                print(f"{'ok ' if ok else 'BAD'} {scheme:8} compute {str(compute)[6:]:8} kv {kv:5} "
                      f"rel err per step: {' '.join(f'{e:.1e}' for e in errs)}", flush=True)
    failures += not graphs_match_eager()
    print(f"{failures} failures")
    return 1 if failures else 0



def graphs_match_eager() -> bool:
    """Three concurrent greedy requests on the engine: CUDA-graph decode (chained steps, the default, and one step
    a replay) against eager decode, same tokens (with the compute dtype's KV, and with int4ch/int4, whose graphs
    also take the sequences' stage slots)."""
    from localpd.engine import Engine
    from localpd.engine.sampling import SamplingParams

    ok = True
    for kv in (None, "int4ch/int4"):
        outs = []
        for graphs, chain in ((False, None), (True, None), (True, 1)):
            e = Engine("synthetic:smollm2-135m", device="cuda", quant="int4-g32", kv=kv, max_context=256,
                       kv_memory="256MiB", cuda_graphs=graphs, decode_chain=chain)
            params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            handles = [e.submit(list(range(5 + i, 30 + 7 * i)), params) for i in range(3)]
            outs.append([[ev.token_id for ev in h if ev.token_id is not None] for h in handles])
            e.close()
        total = sum(len(x) for x in outs[0])
        for name, out in zip(("chained steps", "one step a replay"), outs[1:]):
            same = sum(a == b for x, y in zip(outs[0], out) for a, b in zip(x, y))
            ok &= same == total
            print(f"{'ok ' if same == total else 'BAD'} engine decode with CUDA graphs ({name}) vs eager, kv "
                  f"{kv or 'default'}: {same}/{total} tokens equal")
    return ok


if __name__ == "__main__":
    sys.exit(main())
