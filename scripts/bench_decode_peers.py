"""Batch-1 decode of Llama-3-8B shapes (random weights): localpd beside plain-torch peers, measured in one run.

Peers: a plain torch bf16 decode loop (eager), and a gpt-fast-style loop with torch's int4 tinygemm kernel
(`aten._weight_int4pack_mm`, group 128), eager and replayed as a CUDA graph. localpd runs its engine on
`synthetic:llama3-8b` with int4-g128 and int8, each on the K-major GEMV (quant/kmajor.py, what a GPU runs) and on
bf16; with --all also on the row-major GEMV (Transformer.gpu_layout = False), with the fusions off
(Transformer.fused = False: the 12 kernels a layer of before them) and eager, all measured in the same run.
Each line prints tok/s, the weight bytes streamed per second and that as a share of the measured copy bandwidth
(MBU), and the ratio to localpd int4-g128.

    python scripts/bench_decode_peers.py [--model llama3-8b] [--steps 128] [--context 128] [--all] [--o-apart]
                                         [--short] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from localpd.measure.bench_kernels import tinygemm
from localpd.measure.device import measure_copy_bandwidth
from localpd.load.synthetic import SYNTHETIC


class TorchLlama:
    """The smallest Llama decode loop: static KV cache [L, 2, Hkv, ctx, D], SDPA, bf16 or tinygemm int4."""

    def __init__(self, c, int4: bool, ctx: int, device="cuda"):
        self.c, self.ctx = c, ctx
        d, hd = c.dim, c.head_dim
        nq, nkv = c.n_heads * hd, c.n_kv_heads * hd
        self.nbytes = 0

        def lin(n, k):
            if int4:
                fn, nbytes = tinygemm(torch.empty(n, k, device=device, dtype=torch.bfloat16), 128)
            else:
                w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                fn, nbytes = (lambda x, w=w: F.linear(x, w)), w.numel() * 2
            self.nbytes += nbytes
            return fn

        self.layers = [dict(qkv=lin(nq + 2 * nkv, d), o=lin(d, nq), w13=lin(2 * c.ffn_dim, d), w2=lin(d, c.ffn_dim),
                            n1=torch.ones(d, device=device, dtype=torch.bfloat16),
                            n2=torch.ones(d, device=device, dtype=torch.bfloat16)) for _ in range(c.n_layers)]
        self.embed = torch.randn(c.vocab_size, d, device=device, dtype=torch.bfloat16) * 0.02
        self.head = lin(c.vocab_size, d)
        self.norm = torch.ones(d, device=device, dtype=torch.bfloat16)
        self.nbytes += 2 * d * (2 * c.n_layers + 1) + 2 * d  # norms and one embedding row
        self.cache = torch.zeros(c.n_layers, 2, c.n_kv_heads, ctx, hd, device=device, dtype=torch.bfloat16)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        self.inv_freq = inv

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """token [1] int64, pos [1] int64 (device tensors, so the step can be captured) -> next token [1]."""
        c = self.c
        hd = c.head_dim
        x = self.embed[token]
        ang = pos.float()[:, None] * self.inv_freq[None]
        cos, sin = ang.cos(), ang.sin()
        mask = (torch.arange(self.ctx, device=token.device) <= pos)[None, None, None]

        def rope(t):
            t1, t2 = t[..., : hd // 2].float(), t[..., hd // 2:].float()
            return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), -1).to(t.dtype)

        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (c.dim,), L["n1"], c.norm_eps)
            q, k, v = L["qkv"](h).split([c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd], -1)
            q, k = rope(q.view(1, c.n_heads, hd)), rope(k.view(1, c.n_kv_heads, hd))
            self.cache[i, 0].index_copy_(1, pos, k.transpose(0, 1))
            self.cache[i, 1].index_copy_(1, pos, v.view(1, c.n_kv_heads, hd).transpose(0, 1))
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.cache[i, 0][None], self.cache[i, 1][None],
                                               attn_mask=mask, enable_gqa=True)
            x = x + L["o"](o[0].transpose(0, 1).reshape(1, -1))
            h = F.rms_norm(x, (c.dim,), L["n2"], c.norm_eps)
            g, u = L["w13"](h).chunk(2, -1)
            x = x + L["w2"](F.silu(g) * u)
        return self.head(F.rms_norm(x, (c.dim,), self.norm, c.norm_eps)).argmax(-1)


def time_loop(step, steps: int, start: int) -> float:
    """Seconds per token over `steps` greedy steps, CUDA events, after warm-up."""
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.full((1,), start, dtype=torch.long, device="cuda")
    for _ in range(3):
        step(token, pos)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for i in range(steps):
        pos.fill_(start + i)
        token = step(token, pos)
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / 1000 / steps


def graphed(model: TorchLlama):
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model.step(token, pos)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model.step(token, pos)

    def step(t, p):
        token.copy_(t)
        pos.copy_(p)
        g.replay()
        return out

    return step


def localpd_decode(name: str, quant: str, steps: int, context: int, graphs: bool = True,
                   fused: bool = True, kmajor: bool = True, dp4a: bool = True,
                   o_apart: bool = False, chain: int | None = None, repeats: int = 1) -> tuple[float, int]:
    from localpd.engine import Engine
    from localpd.kernels import gemv_dp4a
    from localpd.engine.sampling import SamplingParams
    from localpd.model.transformer import Transformer

    Transformer.gpu_layout = kmajor
    gemv_dp4a.ENABLED = dp4a
    engine = Engine(f"synthetic:{name}", device="cuda", quant=quant, max_context=context + steps + 16,
                    kv_memory="2GiB", cuda_graphs=graphs, decode_chain=chain)
    engine.model.fused = fused  # before the warm-up, which captures the graphs
    if o_apart:  # o's input rounded in a launch of its own, not by the attention's reduce
        engine.model._o_input = lambda *a: None
    try:
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        prompt = torch.randint(0, engine.config.vocab_size, (context,)).tolist()
        list(engine.submit(prompt, params))  # warm-up: compiles, autotunes, captures
        per_token = []
        for _ in range(repeats):  # a fresh prompt each time (no prefix-cache hit), the median of their tokens' time
            h = engine.submit(torch.randint(0, engine.config.vocab_size, (context,)).tolist(), params)
            list(h)
            per_token.append(h.stats.decode_seconds / max(1, h.stats.output_tokens - 1))
        return sorted(per_token)[len(per_token) // 2], engine.model.weight_bytes
    finally:
        engine.close()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--all", action="store_true", help="also the row-major GEMV, the unfused and the eager engine")
    ap.add_argument("--o-apart", action="store_true", help="also int4-g128 and int8 with o's input rounded in a "
                    "launch of its own (before 15bd2d4), beside the same engine with it rounded by the reduce")
    ap.add_argument("--chains", default="", help="also int4-g128 with these decode steps a step (Engine's "
                    "decode_chain; comma-separated), beside the default (engine.CHAIN_STEPS) and 1")
    ap.add_argument("--short", action="store_true", help="only localpd int4-g128 and int8 (chained, integer GEMV) "
                    "and the tinygemm CUDA-graph loop: an A/B's quick run")
    ap.add_argument("--repeats", type=int, default=3, help="requests timed an engine (their median)")
    args = ap.parse_args()
    c = SYNTHETIC[args.model]
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"# {torch.cuda.get_device_name()} | measured copy bandwidth {bw / 1e9:.0f} GB/s | {args.model} B=1, "
          f"context {args.context}, {args.steps} steps")
    rows = []
    runs = [("int4-g128", True, True, True, True), ("int8", True, True, True, True), ("bf16", True, True, True, True),
            ("int4-g128", True, True, True, False), ("int8", True, True, True, False),
            ("int4-g128", True, True, True, True, False, 1), ("int8", True, True, True, True, False, 1)]
    if args.short:
        runs = runs[:2]
    if args.all:  # the row-major GEMV autotunes each shape's launch on first use: minutes on a fresh machine
        runs += [("int4-g128", True, True, False, True), ("int8", True, True, False, True),
                 ("int4-g128", True, False, True, True), ("int4-g128", False, True, True, True)]
    runs += [("int4-g128", True, True, True, True, False, int(k)) for k in args.chains.split(",") if k]
    if args.o_apart:
        runs += [("int4-g128", True, True, True, True, True), ("int8", True, True, True, True, True)]
    for quant, graphs, fused, kmajor, dp4a, *more in runs:
        o_apart, chain = (more + [False, None])[:2]  # chain None: the engine's default (steps chained on graphs)
        sec, nbytes = localpd_decode(args.model, quant, args.steps, args.context, graphs, fused, kmajor, dp4a,
                                     o_apart, chain, args.repeats)
        gemv = "row-major GEMV" if not kmajor else "integer K-major GEMV" if dp4a else "float K-major GEMV"
        gemv += ", o's input rounded apart" if o_apart else ""
        gemv += ", one decode step a replay" if chain == 1 else f", {chain} decode steps a replay" if chain else ""
        how = ("CUDA graphs" if graphs else "eager") + ("" if fused else ", unfused") + \
            (f", {gemv}" if quant != "bf16" else "")
        rows.append((f"localpd {quant} (engine, {how}, wall clock per token)", sec, nbytes))
        torch.cuda.empty_cache()
    for int4 in (True,) if args.short else (False, True):
        model = TorchLlama(c, int4, ctx=math.ceil((args.context + args.steps + 8) / 256) * 256)
        label = "torch int4 tinygemm g128" if int4 else "torch bf16"
        if not args.short:
            rows.append((f"{label} eager", time_loop(model.step, args.steps, args.context), model.nbytes))
        try:
            rows.append((f"{label} CUDA graph", time_loop(graphed(model), args.steps, args.context), model.nbytes))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"{label} CUDA graph: failed ({type(e).__name__}: {str(e)[:100]})")
        del model
        torch.cuda.empty_cache()
    ours = rows[0][1]
    print("| decode loop | tok/s | weight GB/s | MBU (measured copy bw) | vs localpd int4-g128 |")
    print("|---|---|---|---|---|")
    for label, sec, nbytes in rows:
        print(f"| {label} | {1 / sec:.1f} | {nbytes / sec / 1e9:.0f} | {nbytes / sec / bw:.1%} | "
              f"{ours / sec:.2f}x |")


if __name__ == "__main__":
    main()
