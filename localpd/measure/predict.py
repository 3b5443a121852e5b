"""`localpd bench kernels --predict`: what a model's batch-1 decode GEMVs compile to, and the share of copy bandwidth
that predicts, without a GPU (issue 32).

Each decode linear of the model (qkv, o, gate_up, down, the head) is compiled as kernels/gemv_dp4a.py (the model's
GEMV for 16-bit activations) and kernels/gemv_kmajor.py launch it (one row, the default tile, no input step) for each card's architecture with Triton's compiler
and ptxas, and its main loop read from the disassembly (measure/sass.py). Per kernel: programs, bytes a program
loads, the 16-byte loads a trip against the weight words' own, bytes in flight per SM, SASS instructions per weight
word, registers and spilled bytes, and a predicted % of copy bandwidth from this model:

    time = launch_us(programs) + ROUND_TRIP_US x round trips + bytes / (efficiency x bandwidth)
    efficiency = min(1, instruction budget / instructions per word, bytes in flight per SM / (bandwidth x
                 LATENCY_US / SMs))

where the round trips are the ones a program waits on in turn (its first loads, and split-K's reduction: two), the
bytes are DRAM's (the weights, their factors, the outputs: the activations, a few KB the kernel before wrote, come
from L2 and L1, their latency in the round trips), and an SM issues 128 thread-instructions a clock, so at full
bandwidth there are SMs x 128 x clock / (bandwidth / 4) instruction slots per 4-byte word. Static counts are not
timings: the constants are stated with their sources, and docs/PERF.md sets the prediction beside a GPU's
measurement when one is at hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from localpd.load.synthetic import SYNTHETIC

# A kernel's time above its bytes: its launch, then the global-memory round trips each program waits on in turn.
# H100, 2026-11-26 (scripts/gpu_floor.py, docs/PERF.md, CUDA-graph replays with PDL): an empty kernel of 1056
# programs 1.82 us a launch; a program's trips, each waiting on its loads, 0.7-0.85 us each (26.4 us for 32 trips,
# 15.4 for 16, 8.6 for 8); the split-K GEMV of the model 3.9-4.7 us above its bytes on every real shape, and its
# column tile in 16 or 32 slices of one trip 4.1-4.2 us: the launch, the first trip's round trip, and the
# reduction's two (the fenced atomic that counts a slice in, the last slice's reload of the partials). A GEMV
# whose programs take all of K (kernels/gemv_strip.py) keeps the launch and the first round trip. The empty
# kernel of one program took 0.51 us: a launch of fewer programs is taken as costing in proportion between the two
# (not measured between them; gpu_floor.py times empty kernels of 1-16 programs an SM to check), and no more than
# LAUNCH_US past them (the GEMVs of 1056-1584 programs fit it).
LAUNCH_US = 1.8
LAUNCH_ONE_US = 0.51  # an empty kernel of one program
LAUNCH_PROGRAMS = 1056  # ... and of LAUNCH_US's 1056 (8 an SM)
ROUND_TRIP_US = 0.8
REDUCE_ROUND_TRIPS = 2  # split-K's fenced atomic and the partials' reload
# A launch's cost more on a card without PDL (sm_86, sm_89: kernels/pdl.py), where a kernel's programs start only
# once the one before has finished: the H100's GEMVs with PDL off took 0.7-2.2 us more a launch than with it on
# (gpu_floor.py, 2026-11-26, CUDA-graph replays: 128 x 4096 0.94, o 2.18, qkv 2.19, down 1.66, int8 4096 x 4096
# 0.69; their mean). Not measured on those cards.
NO_PDL_US = 1.5


def launch_us(programs: int, pdl: bool = True) -> float:
    """A launch of this many programs, PDL on (LAUNCH_ONE_US to LAUNCH_US, in proportion); NO_PDL_US more where
    the card has no PDL."""
    share = (min(programs, LAUNCH_PROGRAMS) - 1) / (LAUNCH_PROGRAMS - 1)
    return LAUNCH_ONE_US + (LAUNCH_US - LAUNCH_ONE_US) * max(0.0, share) + (0.0 if pdl else NO_PDL_US)


def floor_us(split: int, programs: int = LAUNCH_PROGRAMS, pdl: bool = True) -> float:
    """The predicted time above a GEMV's bytes for a launch of `split` slices of K and `programs` programs."""
    return launch_us(programs, pdl) + ROUND_TRIP_US * (1 + (REDUCE_ROUND_TRIPS if split > 1 else 0))


LATENCY_US = 0.7  # DRAM latency a load waits, for Little's law (issue 32: 2.95 TB/s x 0.7 us / 132 = 16 KB an SM)
REGISTERS_PER_SM = 65536
STAGED = 3  # dp4a-staged's pipeliner stages (kernels/gemv_dp4a.py STAGES): 2 trips ahead in shared memory


@dataclass(frozen=True)
class Card:
    name: str
    arch: int
    sms: int
    ghz: float  # boost clock
    gbs: float  # copy bandwidth
    source: str
    shared_kb: int  # shared memory an SM gives its programs (CUDA's occupancy tables)
    max_programs: int = 32  # resident blocks an SM (CUDA's tables: 9.0 32, 8.9 24, 8.6 16; 12.0 taken as 24)
    max_threads: int = 2048  # resident threads an SM (1536 on 8.6, 8.9 and 12.0)

    @property
    def pdl(self) -> bool:
        """Whether its kernels take programmatic dependent launch (kernels/pdl.py)."""
        from localpd.kernels.pdl import arch_has_pdl

        return arch_has_pdl(self.arch)

    def budget(self) -> float:
        """Instruction slots per 4-byte word at full bandwidth."""
        return self.sms * 128 * self.ghz * 1e9 / (self.gbs * 1e9 / 4)

    def fits(self, threads: int, registers: int, shared: int) -> int:
        """Programs of `threads` threads, `registers` registers a thread and `shared` bytes an SM holds at once."""
        return min(self.max_programs, self.max_threads // threads, REGISTERS_PER_SM // max(1, registers * threads),
                   self.shared_kb * 1024 // max(1, shared))

    def efficiency(self, per_word: float, in_flight: float) -> float:
        """The share of bandwidth a loop of per_word instructions a word with in_flight bytes in flight an SM keeps:
        min(1, budget / instructions a word, in flight / (bandwidth x LATENCY_US / SMs))."""
        need = self.gbs * 1e9 * LATENCY_US * 1e-6 / self.sms
        return min(1.0, self.budget() / per_word, in_flight / need)


CARDS = [Card("H100 SXM", 90, 132, 1.98, 2950, "copy measured on the device tool, 2026-11-23", 227),
         Card("H200", 90, 132, 1.98, 4200, "copy measured on the device tool, 2026-11-26", 227),
         Card("RTX 5090", 120, 170, 2.41, 1792, "datasheet", 99, 24, 1536),
         Card("RTX 4090", 89, 128, 2.52, 1008, "datasheet", 99, 24, 1536),
         Card("RTX 3090", 86, 82, 1.70, 936, "datasheet", 99, 16, 1536)]
FORMATS = {"int4-g128": (4, 128), "int8": (8, 0)}  # bits, group (0: per output row)


@dataclass
class Prediction:
    card: str
    kernel: str  # dp4a (kernels/gemv_dp4a.py), dp4a-staged (the same, STAGES = STAGED), kmajor (gemv_kmajor.py) or
    # strip (gemv_strip.py)
    format: str
    linear: str
    n: int
    k: int
    programs: int
    split: int  # slices of K a column tile is cut into (1: no split-K reduction)
    waves: float  # programs over those the SMs hold at once (registers, shared memory): past 1, a tail starts late
    bytes_per_program: int
    wide_loads: str  # 16-byte loads a trip / the weight words' 16-byte loads a trip
    in_flight_per_sm: int
    per_word: float
    registers: int
    spilled: int
    barriers: int
    predicted: float  # share of copy bandwidth
    predicted_us: float
    bytes: int  # DRAM's: the weights, their factors, the outputs


def decode_linears(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decode layer's linears and the head, as the model fuses them (q/k/v, gate/up)."""
    c = SYNTHETIC[model]
    hd = c.head_dim
    return [("qkv", (c.n_heads + 2 * c.n_kv_heads) * hd, c.dim), ("o", c.dim, c.n_heads * hd),
            ("gate_up", 2 * c.ffn_dim, c.dim), ("down", c.dim, c.ffn_dim), ("lm_head", c.vocab_size, c.dim)]


@dataclass
class Launch:
    """A GEMV compiled as the model launches it for a kind of shape, and what the prediction needs of its launch."""
    kernel: object  # the compiled kernel
    words_per_thread: float  # weight words a thread loads a trip
    threads: int
    trip_inputs: int  # inputs (K) a trip covers: split-K slices are whole trips
    prefetch: int  # trips ahead a trip's words are loaded: in registers (PREFETCH), or staged in shared memory
    per_sm: int  # programs an SM the split-K is sized for
    outputs: int = 128  # outputs a program (a column tile) takes


def compile_gemv(bits: int, group: int, n: int, k: int, arch: int, kernel: str, sms: int) -> Launch:
    """The decode GEMV at one row as the model launches it (no input step), for sm_<arch>: kernels/gemv_dp4a.py's
    (the model's for 16-bit activations; the input step before it rounds its activations, except o's, whose
    rounding is a launch of its own, not counted here), gemv_kmajor's or gemv_strip's (its tile for a card of `sms`
    SMs)."""
    from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km
    from localpd.measure.sass import compile_launch

    if kernel == "strip":
        return compile_strip(bits, group, n, k, arch, sms)
    tile = km.DEFAULT_TILE
    g = min(group or k, k)
    gk = group if 0 < group < k else 1 << 30
    out, ws, cnt = torch.empty(1, n, dtype=torch.bfloat16), torch.empty(1), torch.empty(1, dtype=torch.int32)
    words = torch.empty(k * bits // 32, n, dtype=torch.int32)
    factors = torch.empty(k // g, n, dtype=torch.int32)
    if kernel in ("dp4a", "dp4a-staged"):
        nb = dp.blocks_a_trip(k)
        warps = min(nb, dp.DEFAULT_TILE["num_warps"])
        stages, prefetch = (STAGED, 0) if kernel == "dp4a-staged" else (1, dp.DEFAULT_TILE["PREFETCH"])
        q, s = torch.empty(1, k // 2, dtype=torch.int32), torch.empty(1, k // 16)
        args = (q, s, out, words, factors, 1, n, k, q.stride(0), s.stride(0), out.stride(0), words.stride(0),
                factors.stride(0), ws, cnt, 2, out)
        kwargs = dict(BITS=bits, GROUP=gk, BLOCK_N=km.BLOCK_N, NB=nb, BLOCK_M=1, OUT_BIAS=False, ASM=True,
                      PREFETCH=prefetch, STAGES=stages, num_warps=warps, num_stages=stages)
        return Launch(compile_launch(dp._gemv_dp4a_kernel, args, kwargs, arch), bits * 4 * nb / warps, 32 * warps,
                      32 * nb, prefetch + stages - 1, dp.DEFAULT_TILE["per_sm"])
    bk = km.launch_block_k(k, bits, g, tile["BLOCK_K"])
    x = torch.empty(1, k, dtype=torch.bfloat16)
    args = (x, out, words, factors, 1, n, k, x.stride(0), out.stride(0), words.stride(0), factors.stride(0), ws, cnt,
            2, x, x, x, k, k, 1e-5, x)
    kwargs = dict(BITS=bits, GROUP=gk, BLOCK_N=km.BLOCK_N, BLOCK_K=bk, GATED="", NORM=False, HAS_RES=False,
                  OUT_BIAS=False, PREFETCH=tile["PREFETCH"], BLOCK_M=1, num_warps=tile["num_warps"], num_stages=1)
    threads = 32 * tile["num_warps"]
    return Launch(compile_launch(km._gemv_kmajor_kernel, args, kwargs, arch), bk * bits / 32 * km.BLOCK_N / threads,
                  threads, bk, tile["PREFETCH"], tile["per_sm"])


def compile_strip(bits: int, group: int, n: int, k: int, arch: int, sms: int) -> Launch:
    """kernels/gemv_strip.py's GEMV at one row as gemv_strip_rounded launches it on a card of `sms` SMs with no
    measured tile (designed_tile), for sm_<arch>."""
    from localpd.kernels import gemv_strip as gs
    from localpd.measure.sass import compile_launch

    tile = gs.designed_tile(n, sms)
    g = min(group or k, k)
    rows = k * bits // 32
    lanes = 32 * tile["num_warps"] * tile["rows_a_lane"]
    out = torch.empty(1, n, dtype=torch.bfloat16)
    words = torch.empty(n // gs.STRIP, rows, gs.STRIP, dtype=torch.int32)
    factors = torch.empty(n // gs.STRIP, k // g, gs.STRIP, dtype=torch.int32)
    q, s = torch.empty(1, k // 2, dtype=torch.int32), torch.empty(1, k // 16)
    args = (q, s, out, words, factors, out, 1, n, k, q.stride(0), s.stride(0), out.stride(0), words.stride(0),
            factors.stride(0))
    kwargs = dict(BITS=bits, GROUP=g if g < k else gs.ONE_GROUP, ROWS=lanes, TAIL=rows % lanes != 0, BLOCK_M=1,
                  OUT_BIAS=False, ASM=True, PREFETCH=tile["PREFETCH"], PDL=arch >= 90, STRIPS=tile["strips"],
                  num_warps=tile["num_warps"], num_stages=1)
    return Launch(compile_launch(gs._gemv_strip_kernel, args, kwargs, arch),
                  tile["rows_a_lane"] * gs.STRIP * tile["strips"], 32 * tile["num_warps"], k, tile["PREFETCH"], 0,
                  gs.STRIP * tile["strips"])


def predict(model: str = "llama3-8b", cards=CARDS, formats=FORMATS, kernels=("dp4a",)) -> list[Prediction]:
    from localpd.kernels import gemv_kmajor as km, gemv_strip as gs
    from localpd.measure.sass import cuobjdump, loop_stats, main_loop

    compiled: dict = {}
    rows = []
    for card in cards:
        for kernel in kernels:
            for fmt, (bits, group) in formats.items():
                for name, n, k in decode_linears(model):
                    # what a launch compiles to depends on: K in whole trips (and strip's tail: K % 2048)
                    # (and strip's tile for the shape on the card)
                    key = (card.arch, kernel, bits, group, k % 128 == 0, k % 64 == 0, k % 2048 == 0,
                           str(gs.designed_tile(n, card.sms)) if kernel == "strip" else "")
                    if key not in compiled:
                        launch = compile_gemv(bits, group, n, k, card.arch, kernel, card.sms)
                        compiled[key] = launch, loop_stats(launch.kernel, launch.words_per_thread), \
                            main_loop(cuobjdump(launch.kernel.asm["cubin"]))
                    launch, stats, body = compiled[key]
                    wide = sum(op.startswith(("LDG.E.128", "LDGSTS")) and op.endswith(".128") for op in body)
                    weight_wide = int(launch.words_per_thread // 4)  # 4 words a 16-byte load
                    split = km.split_for(1, n, k, launch.trip_inputs, card.sms, launch.per_sm) \
                        if launch.trip_inputs < k else 1
                    tiles = -(-n // launch.outputs)
                    programs = tiles * split
                    g = group or k
                    nbytes = n * k * bits // 8 + 4 * n * (k // g) + 2 * n  # DRAM's: weights, factors, outputs
                    fit = card.fits(launch.threads, stats.registers, launch.kernel.metadata.shared)
                    resident = min(-(-programs // card.sms), fit)
                    trip_bytes = launch.words_per_thread * 4 * launch.threads * (1 + int(launch.prefetch))
                    in_flight = int(resident * trip_bytes)
                    eff = card.efficiency(stats.per_word, in_flight)
                    seconds = floor_us(split, programs, card.pdl) * 1e-6 + nbytes / (eff * card.gbs * 1e9)
                    rows.append(Prediction(card.name, kernel, fmt, name, n, k, programs, split,
                                           round(programs / (fit * card.sms), 2), nbytes // programs,
                                           f"{wide}/{weight_wide}", in_flight, stats.per_word, stats.registers,
                                           stats.spilled, stats.barriers, nbytes / (card.gbs * 1e9) / seconds,
                                           seconds * 1e6, nbytes))
    return rows


def run(args) -> int:
    cards = [c for c in CARDS if not args.cards or any(w.lower() in c.name.lower() for w in args.cards.split(","))]
    named = {"dp4a": "dp4a (kernels/gemv_dp4a.py, the model's for 16-bit activations, DEFAULT_TILE)",
             "dp4a-staged": f"dp4a-staged (the same, PREFETCH 0 and STAGES {STAGED}: weights through shared memory)",
             "kmajor": "kmajor (kernels/gemv_kmajor.py, float products)",
             "strip": "strip (kernels/gemv_strip.py, 4 outputs a program over all of K: no split-K)"}
    kernels = tuple((args.kernels or "dp4a,strip,kmajor").split(","))
    if not set(kernels) <= set(named):
        raise SystemExit(f"--kernels takes {', '.join(named)}, not {args.kernels}")
    rows = predict(args.model or "llama3-8b", cards, kernels=kernels)
    print(f"# {args.model or 'llama3-8b'}: batch-1 decode GEMVs compiled per card, no GPU used: "
          f"{'; '.join(named[k] for k in kernels)}; model: time = launch ({LAUNCH_ONE_US} us for one program to "
          f"{LAUNCH_US} for {LAUNCH_PROGRAMS} and more, in proportion; {NO_PDL_US} us more without PDL) + "
          f"{ROUND_TRIP_US} us x (1 + "
          f"{REDUCE_ROUND_TRIPS} with split-K) + bytes / (efficiency x bandwidth), efficiency = min(1, budget / "
          f"instructions a word, in flight / (bandwidth x {LATENCY_US} us / "
          f"SMs))")
    for card in cards:
        print(f"#   {card.name} sm_{card.arch}: {card.sms} SMs, {card.gbs} GB/s ({card.source}), "
              f"{card.budget():.0f} instruction slots a word{'' if card.pdl else ', no PDL'}")
    print(f"{'card':>9} {'kernel':>11} {'format':>9} {'linear':>8} {'N':>6} {'K':>6} {'programs':>8} {'split':>5} {'waves':>5} "
          f"{'KB/prog':>7} {'16B ld':>6} "
          f"{'KB flight/SM':>12} {'instr/word':>10} {'regs':>4} {'spill':>5} {'bar':>3} {'predicted':>9}")
    for r in rows:
        print(f"{r.card:>9} {r.kernel:>11} {r.format:>9} {r.linear:>8} {r.n:>6} {r.k:>6} {r.programs:>8} {r.split:>5} {r.waves:>5} "
              f"{r.bytes_per_program / 1024:>7.1f} {r.wide_loads:>6} {r.in_flight_per_sm / 1024:>12.1f} "
              f"{r.per_word:>10} {r.registers:>4} {r.spilled:>5} {r.barriers:>3} "
              f"{r.predicted:>5.0%} {r.predicted_us:5.1f}us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "llama3-8b", "launch_us": LAUNCH_US, "no_pdl_us": NO_PDL_US,
                       "round_trip_us": ROUND_TRIP_US,
                       "reduce_round_trips": REDUCE_ROUND_TRIPS, "latency_us": LATENCY_US,
                       "cards": [asdict(c) for c in cards], "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
