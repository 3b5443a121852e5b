"""`localpd bench kernels --predict --step`: a whole batch-1 decode token of a model, predicted per card from the
compiled code, and the share of copy bandwidth (MBU) that makes (issue 32's MBU targets, without a GPU).

A decode step of a Llama-layout model launches, each layer: the residual add + RMSNorm that rounds the qkv GEMV's
input, the qkv GEMV, RoPE + KV write, decode attention and its reduce (which rounds o's input), the o GEMV, the
second residual add + RMSNorm, the gate_up GEMV, SiLU * up (rounding down's input), the down GEMV; then the final
norm and the output head. The token's time is the sum of its launches' predicted times (a CUDA graph replays them
one after another; with PDL a launch's start overlaps the one before, which the launch term already counts):

- the GEMVs: measure/predict.py's rows (`kernel`: dp4a, the engine's K-major GEMV on every card until a card is
  measured faster in strips, or strip), the head at int8 under the int4 schemes (quant/schemes.head_scheme);
- the attention: measure/predict_attention.py's at the context, under a page table as wide as the model's context
  (what the engine's CUDA graphs are built for);
- each small launch: predict.launch_us(its programs) + one round trip (its loads, waited on before anything is
  written) + its bytes at copy bandwidth.

MBU is the token's DRAM bytes (every weight and factor once, the KV cache's context, the small launches' rows)
over its time, against the card's copy bandwidth. The H100's measurement of the K-major (dp4a) step (docs/PERF.md,
2026-11-26, Llama-3-8B int4-g128, 128 tokens of context, a 272-token table: the graph replayed alone 2.513 ms a
token; launched one by one without PDL, the small launches 7.7 us a layer and the attention with its reduce 6.2)
sets the model beside a GPU: see docs/PERF.md for how far apart they were.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from localpd.errors import LocalpdError
from localpd.load.synthetic import SYNTHETIC
from localpd.measure.predict import CARDS, FORMATS, ROUND_TRIP_US, Card, launch_us, predict
from localpd.measure.predict_attention import predict_attention
from localpd.quant.schemes import head_scheme

LAYOUTS = ("llama", "qwen2", "phi3")  # the decoders whose layers launch what small_launches counts (Qwen3's qk-norm
# and Gemma 3's extra norms launch more)


@dataclass
class StepPrediction:
    card: str
    kernel: str  # the GEMVs' (measure/predict.py's kernels)
    format: str
    kv: str
    context: int
    gemv_us: float  # the layers' four GEMVs, all layers
    head_us: float
    attention_us: float  # decode attention and its reduce, all layers
    small_us: float  # the norms, RoPE + KV write, SiLU * up: all layers, and the final norm
    launches: int
    token_us: float
    bytes: int
    mbu: float  # share of copy bandwidth

    @property
    def tok_s(self) -> float:
        return 1e6 / self.token_us


def check_layout(model: str):
    """The synthetic model's config, if its layers launch what small_launches counts."""
    c = SYNTHETIC[model]
    if c.arch not in LAYOUTS:
        raise LocalpdError(f"--predict --step models the layers of {', '.join(LAYOUTS)} decoders; {model} is {c.arch}")
    return c


def small_launches(model: str) -> list[tuple[str, int, int, int]]:
    """(name, programs, DRAM bytes, launches a token) of a decode step's small launches, as kernels/fused_dispatch.py
    and kvcache/dispatch.py size their grids for one row."""
    from localpd.kernels.fused_dispatch import norm_slice, triton_block

    c = SYNTHETIC[model]
    hd, L = c.head_dim, c.n_layers
    row = 2 * c.dim  # a bf16 row of the residual stream
    rounded = c.dim * 2 + c.dim // 32 * 4  # two int8 levels a value and a scale a block of 32 (kernels/act_round.py)
    norm = ("residual add + RMSNorm", -(-c.dim // norm_slice(1, c.dim)), 3 * row + row + rounded, 2 * L)
    rope = ("RoPE + KV write", c.n_heads + 2 * c.n_kv_heads, 2 * (c.n_heads + 2 * c.n_kv_heads) * hd * 2, L)
    block = max(32, min(1024, triton_block(c.ffn_dim)))
    act = ("SiLU * up", -(-c.ffn_dim // block), 2 * c.ffn_dim * 2 + c.ffn_dim * 2 + c.ffn_dim // 32 * 4, L)
    final = ("final norm", 1, 3 * row, 1)
    return [norm, rope, act, final]


def small_us(card: Card, programs: int, nbytes: int) -> float:
    """A small launch's predicted time: its launch, the round trip of its loads, its bytes at copy bandwidth."""
    return launch_us(programs, card.pdl) + ROUND_TRIP_US + nbytes / (card.gbs * 1e9) * 1e6


def predict_step(card: Card, model: str = "llama3-8b", fmt: str = "int4-g128", kernel: str = "dp4a",
                 kv: str = "bf16", context: int = 128, table: int | None = None) -> StepPrediction:
    c = check_layout(model)
    layers = [r for r in predict(model, [card], {fmt: FORMATS[fmt]}, (kernel,)) if r.linear != "lm_head"]
    head_fmt = head_scheme("lm_head", fmt, tied=False)  # int8 under the int4 schemes
    (head,) = [r for r in predict(model, [card], {head_fmt: FORMATS[head_fmt]}, (kernel,)) if r.linear == "lm_head"]
    att = predict_attention(card, kv, context, c.n_heads, c.n_kv_heads, c.head_dim, table or c.max_context)
    small = small_launches(model)
    gemv_us = c.n_layers * sum(r.predicted_us for r in layers)
    attention_us = c.n_layers * att.predicted_us
    small_total = sum(n * small_us(card, programs, nbytes) for _, programs, nbytes, n in small)
    token_us = gemv_us + head.predicted_us + attention_us + small_total
    nbytes = (c.n_layers * (sum(r.bytes for r in layers) + att.bytes) + head.bytes
              + sum(n * b for _, _, b, n in small))
    launches = c.n_layers * (len(layers) + 2) + 1 + sum(n for *_, n in small)  # attention: the kernel and its reduce
    return StepPrediction(card.name, kernel, fmt, kv, context, gemv_us, head.predicted_us, attention_us, small_total,
                          launches, token_us, nbytes, nbytes / (card.gbs * 1e9) / (token_us * 1e-6))


def run(args) -> int:
    cards = [c for c in CARDS if not args.cards or any(w.lower() in c.name.lower() for w in args.cards.split(","))]
    model = args.model or "llama3-8b"
    check_layout(model)
    kernels = (args.kernels or "dp4a,strip").split(",")
    kv = args.kv or "bf16"
    contexts = [int(x) for x in (args.context or "128,4096").split(",")]
    print(f"# {model}: a batch-1 decode token predicted from the compiled code, no GPU used (measure/predict_step.py): "
          f"GEMVs (measure/predict.py), attention (measure/predict_attention.py, a {SYNTHETIC[model].max_context}-"
          f"token table), small launches (launch + {ROUND_TRIP_US} us + bytes); {kv} KV; us a token")
    print(f"{'card':>9} {'kernel':>6} {'format':>9} {'context':>7} {'GEMVs':>7} {'head':>6} {'attention':>9} "
          f"{'small':>6} {'launches':>8} {'token':>7} {'tok/s':>6} {'GB':>5} {'MBU':>4}")
    rows = []
    for card in cards:
        for kernel in kernels:
            for fmt in FORMATS:
                for context in contexts:
                    r = predict_step(card, model, fmt, kernel, kv, context)
                    rows.append(r)
                    print(f"{r.card:>9} {r.kernel:>6} {r.format:>9} {r.context:>7} {r.gemv_us:>7.0f} "
                          f"{r.head_us:>6.0f} {r.attention_us:>9.0f} {r.small_us:>6.0f} {r.launches:>8} "
                          f"{r.token_us:>7.0f} {r.tok_s:>6.0f} {r.bytes / 1e9:>5.2f} {r.mbu:>4.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "rows": [asdict(r) | {"tok_s": r.tok_s} for r in rows]}, f, indent=1)
    return 0
