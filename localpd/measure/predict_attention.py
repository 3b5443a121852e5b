"""`localpd bench kernels --predict --attention`: what batch-1 decode attention over paged KV compiles to, and the
time that predicts, per KV format and context, without a GPU (issue 32).

kvcache.dispatch.paged_attention is called on CPU tensors shaped like the model's cache; its decode_kernel launch
is captured instead of run and compiled for the card's architecture (measure/sass.py). The launch's programs are
(KV heads, splits) with the splits as dispatch sizes them for a CUDA graph's page table (`table` tokens wide) and
each program walks its split of the sequence's own tokens a tile at a time. The prediction is measure/predict.py's
model with one term more:

    time = launch(programs) + launch(query heads) + 2 x ROUND_TRIP_US + ROUND_TRIP_US x trips x waits
           + bytes / (efficiency x bandwidth)

two launches (the decode kernel and the reduce of its splits, predict.launch_us of their programs), each with its
first round trip; `waits` the DRAM
round trips a loop trip waits on in turn (measure/sass.in_trip_loads: loads whose value the same trip reads, sooner
than the instructions a round trip takes to issue at the SM's rate shared by its resident warps; the pipeliner's
asynchronous copies and loads made a trip ahead wait on none) times the trips a program makes in turn;
bytes the sequence's keys, values and their factors in the format; efficiency measure/predict.py's (instruction
budget against instructions a 4-byte word, bytes in flight an SM against Little's law, with the pipeliner's two
trips ahead in flight). Against the H100's measurement of the reduce-launch kernel at 32k tokens (docs/PERF.md,
2026-11-26: bf16 56, int8 47, int4 55 us), the code then (2 waits a trip for int8, 4 for int4) predicts bf16 48.5,
int8 39 and int4 43 us: 1.25x for int8 against 1.19x measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from localpd.measure.predict import CARDS, LATENCY_US, ROUND_TRIP_US, Card, launch_us

PAGE_SIZE = 16
AHEAD = 2  # trips the pipeliner's asynchronous copies are issued ahead (Triton's default num_stages 3)


class Captured(Exception):
    pass


def attention_launch(kernel: str, kv_dtype: str, n_heads: int, n_kv_heads: int, head_dim: int, context: int = 4096,
                     chunk: int = 512, arch: int = 90):
    """(args, kwargs) of the `kernel` launch ("decode_kernel" or "prefill_kernel") paged_attention makes for one
    bf16 sequence of `context` tokens on a card of compute capability `arch`: one query row (decode) or its last
    `chunk` tokens (prefill)."""
    import localpd.kernels.paged_attention as kernels
    import localpd.kvcache.dispatch as kv_dispatch
    from localpd.kvcache.formats import new_kv_pool

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
    asked = os.environ.get("LOCALPD_TRITON_INTERPRET")
    os.environ["LOCALPD_TRITON_INTERPRET"] = "1"  # Triton's path on CPU tensors (the launch never runs)
    try:
        kv_dispatch.paged_attention(q, layer, table, lens, starts, head_dim ** -0.5)
    except Captured as e:
        args, kwargs = e.args
        if "PAIRS" in kwargs:  # what the card takes, not the interpreter
            kwargs = {**kwargs, "PAIRS": kv_dispatch.prefill_value_pairs(arch)}
        return args, kwargs
    finally:
        setattr(kernels, kernel, real)
        kv_dispatch.attention_dot = gpu_dot
        if asked is None:
            os.environ.pop("LOCALPD_TRITON_INTERPRET")
        else:
            os.environ["LOCALPD_TRITON_INTERPRET"] = asked
    raise RuntimeError(f"paged_attention did not launch {kernel}")


@dataclass
class AttentionPrediction:
    card: str
    kv: str
    context: int
    programs: int
    trips: int  # tiles a program walks in turn
    bytes: int
    per_word: float
    registers: int
    spilled: int
    waited: int  # loads a trip waits on itself
    waits: int  # DRAM round trips a trip waits on in turn
    predicted_us: float


def predict_attention(card: Card, kv_dtype: str, context: int, n_heads: int = 32, n_kv_heads: int = 8,
                      head_dim: int = 128, table: int = 131072) -> AttentionPrediction:
    """One layer's decode attention of one sequence of `context` tokens under a page table `table` tokens wide."""
    import localpd.kernels.paged_attention as kernels
    from localpd.kvcache.dispatch import DECODE_PROGRAMS_PER_SM, cdiv, decode_block_t, splits_for
    from localpd.kvcache.formats import kv_bytes_per_token, kv_formats
    from localpd.measure.sass import compile_launch, cuobjdump, in_trip_loads, loop_body, loop_stats

    args, kwargs = attention_launch("decode_kernel", kv_dtype, n_heads, n_kv_heads, head_dim, arch=card.arch)
    kernel = compile_launch(kernels.decode_kernel, args, kwargs, card.arch)
    block_t = decode_block_t(PAGE_SIZE, head_dim, kv_formats(kv_dtype)[0])
    splits, _ = splits_for(n_kv_heads, cdiv(table, block_t), DECODE_PROGRAMS_PER_SM * card.sms)
    trips = cdiv(cdiv(context, block_t), splits)  # the kernel shares the sequence's own tiles out over the splits
    per_token = kv_bytes_per_token(kv_dtype, 1, n_kv_heads, head_dim, PAGE_SIZE)
    threads = 32 * kwargs["num_warps"]
    stats = loop_stats(kernel, block_t * per_token / n_kv_heads / 4 / threads)
    programs = n_kv_heads * splits
    resident = min(cdiv(programs, card.sms), card.fits(threads, stats.registers, kernel.metadata.shared))
    # a load read this many instructions after its issue waits no more: a warp's instructions issue at best one in
    # (the SM's resident warps / its 4 schedulers) clocks, so these take at least a round trip
    cover = int(ROUND_TRIP_US * 1e3 * card.ghz / max(1.0, resident * threads / 32 / 4))
    waited, waits = in_trip_loads(loop_body(cuobjdump(kernel.asm["cubin"])), cover)
    eff = card.efficiency(stats.per_word, resident * AHEAD * block_t * per_token / n_kv_heads)
    nbytes = context * per_token
    # the decode kernel's launch and its reduce's, each with its first round trip
    launches = launch_us(programs, card.pdl) + launch_us(n_heads, card.pdl) + 2 * ROUND_TRIP_US
    us = launches + ROUND_TRIP_US * trips * waits + nbytes / (eff * card.gbs * 1e9) * 1e6
    return AttentionPrediction(card.name, kv_dtype, context, programs, trips, nbytes, stats.per_word,
                               stats.registers, stats.spilled, waited, waits, us)


def card_takes(card: Card, kv_dtype: str) -> bool:
    """Whether the card holds the format at all: fp8 e4m3 needs sm_89 or newer (kvcache.formats.check_kv_dtype
    refuses it on an RTX 30 card)."""
    from localpd.kvcache.formats import kv_formats

    return "fp8" not in kv_formats(kv_dtype) or card.arch >= 89


def run(args) -> int:
    cards = [c for c in CARDS if not args.cards or any(w.lower() in c.name.lower() for w in args.cards.split(","))]
    kvs = (args.kv or "bf16,int8,fp8,int4,int8/int4").split(",")
    print("# decode attention, one sequence, Llama-3-8B heads (32 query / 8 KV x 128), a 131072-token page table; "
          f"model: time = launch(programs) + launch(query heads) + 2 x {ROUND_TRIP_US} us + {ROUND_TRIP_US} us x "
          "trips x waits + bytes / (efficiency x bandwidth), launch(p) measure/predict.py's")
    print(f"{'card':>9} {'kv':>10} {'context':>7} {'programs':>8} {'trips':>5} {'MB':>6} {'instr/word':>10} "
          f"{'regs':>4} {'spill':>5} {'waited':>6} {'waits':>5} {'predicted':>9} {'x bf16':>6}")
    out = []
    for card in cards:
        for context in (4096, 32768):
            rows = [predict_attention(card, kv, context) for kv in kvs if card_takes(card, kv)]
            out += rows
            base = next((r.predicted_us for r in rows if r.kv == "bf16"), None)
            for r in rows:
                ratio = f"{base / r.predicted_us:.2f}" if base else "-"
                print(f"{r.card:>9} {r.kv:>10} {r.context:>7} {r.programs:>8} {r.trips:>5} {r.bytes / 1e6:>6.1f} "
                      f"{r.per_word:>10} {r.registers:>4} {r.spilled:>5} {r.waited:>6} {r.waits:>5} "
                      f"{r.predicted_us:>7.1f}us {ratio:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"round_trip_us": ROUND_TRIP_US, "latency_us": LATENCY_US,
                       "rows": [asdict(r) for r in out]}, f, indent=1)
    return 0
