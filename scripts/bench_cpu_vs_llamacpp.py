"""localpd against llama.cpp on the CPU: the same GGUF file, the same threads, in one run.

llama.cpp's `llama-bench -m FILE -t T -p 128 -n 0` and `-p 0 -n 128 -d 128` (`-o json`) and `localpd bench
--prompt-len 128 --gen-len 128 --batch 1,8 --threads T --json` run in turn (llama.cpp, localpd, llama.cpp, localpd
... for --repeats rounds), since this shared machine's speed drifts; each round's pair is as close in time as a pair can be. The table gives
every round and the median of the rounds: decode tok/s at batch 1, prefill tok/s of the 128-token prompt, their
ratio (localpd / llama.cpp), and localpd's batch-8 decode (tokens/s summed over the 8 sequences) beside llama.cpp's
batch 1. Both decode after 128 tokens of context: localpd's decode follows its 128-token prompt, and llama.cpp's
tg128 runs at `-d 128` (its pp128 at depth 0). Figures in docs/PERF.md before 2026-12-04 took llama.cpp's tg128 from
an empty context, which reads a third of the KV cache that localpd's decode reads.

    python scripts/bench_cpu_vs_llamacpp.py [--model FILE] [--threads 2] [--quant SCHEME] [--repeats 2]
                                            [--context 1024]

--context N has both decode after N tokens of context instead (llama.cpp's tg128 at `-d N`, localpd's batch-1
decode after an N-token prompt, a `localpd bench` run of its own); prefill and localpd's batch 8 stay at 128.

--int-prefill runs localpd a second time each round with the prefill's products (cpu.GEMM_ROWS rows and more) on
the integer products decode takes (lpd_linear) in place of prefill's GEMM (lpd_prefill_gemm's on AVX512-VNNI, the
float GEMM elsewhere), and prints its prefill beside the GEMM's: what taking decode's products for prefill would cost
or gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENS = 128
# `localpd` with every product on lpd_linear's integer products, prefill's rows too (cpu._gemm replaced, and
# cpu.integer_prefill off so that prefill takes it)
INT_PREFILL = """
import runpy, sys
from localpd.kernels import cpu

def _gemm(lib, p, pre, x, res, nw, eps, s, bias, y):
    if lib.lpd_linear(pre, x.data_ptr(), cpu._ptr(res), cpu._ptr(nw), eps, cpu._ptr(s), x.shape[0], p.k, p.bits, p.data,
                      p.scales, p.biases, p.sub, p.lut, p.high, p.top, p.sc16, p.mn16, p.group, p.n, cpu._ptr(bias),
                      y.data_ptr(), cpu.threads()):
        raise MemoryError("lpd_linear could not allocate its scratch")

cpu._gemm = _gemm
cpu.integer_prefill = lambda: False
sys.argv = ["localpd", *sys.argv[1:]]
runpy.run_module("localpd.cli", run_name="__main__")
"""


def llama_bin() -> str:
    out = subprocess.run(["bash", str(REPO.parent / "shared" / "peers" / "llama-cpp.sh")], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def llama_round(bin_dir: str, model: str, threads: int, context: int = TOKENS) -> dict:
    """llama-bench's pp128 from an empty context and tg128 after `context` tokens of it (localpd's decode's context),
    in two runs (one run of both depths would also time pp128 at that depth and tg128 at 0): {"prefill": tok/s,
    "decode": tok/s}."""
    rows = []
    for test in (["-p", str(TOKENS), "-n", "0"], ["-p", "0", "-n", str(TOKENS), "-d", str(context)]):
        out = subprocess.run([str(Path(bin_dir) / "llama-bench"), "-m", model, "-t", str(threads), *test, "-o", "json"],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-800:]}")
        rows += json.loads(out.stdout)
    pick = {("prefill" if r["n_gen"] == 0 else "decode"): r["avg_ts"] for r in rows}
    return {"prefill": pick["prefill"], "decode": pick["decode"], "type": rows[0].get("model_type", "?")}


def localpd_bench(model: str, threads: int, quant: str | None, prompt: int, batches: str, int_prefill: bool) -> dict:
    """`localpd bench`'s --json: {batch: its point's fields (localpd.bench.Point)} and the run's "quant", "device"."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        run = ["-c", INT_PREFILL] if int_prefill else ["-m", "localpd.cli"]
        cmd = [sys.executable, *run, "bench", model, "--device", "cpu", "--threads", str(threads),
               "--prompt-len", str(prompt), "--gen-len", str(TOKENS), "--batch", batches, "--json", path]
        out = subprocess.run(cmd + (["--quant", quant] if quant else []), capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            sys.exit(f"localpd bench failed ({out.returncode}): {out.stderr.strip()[-800:]}")
        result = json.loads(Path(path).read_text())
    return {**{p["batch"]: p for p in result["points"]}, "quant": result["quant"], "device": result["device"]}


def localpd_round(model: str, threads: int, quant: str | None, int_prefill: bool = False,
                  context: int = TOKENS) -> dict:
    """localpd bench at batch 1 and 8 after a 128-token prompt, and where context differs batch 1 after a prompt of
    that many tokens (its decode then the round's decode); int_prefill: prefill on the integer products
    (INT_PREFILL)."""
    short = localpd_bench(model, threads, quant, TOKENS, "1,8", int_prefill)
    deep = short if context == TOKENS else localpd_bench(model, threads, quant, context, "1", int_prefill)
    return {"prefill": short[1]["prefill_tps"], "decode": deep[1]["decode_tps"], "decode8": short[8]["decode_tps"],
            "mbu": deep[1]["decode_mbu"], "quant": short["quant"], "device": short["device"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: localpd's default model)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--quant", help="localpd's weight scheme (default: localpd's default on the CPU)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--llama-bin", help="folder holding llama-bench (default: ../shared/peers/llama-cpp.sh's output)")
    ap.add_argument("--int-prefill", action="store_true", help="also localpd with prefill on the integer products")
    ap.add_argument("--context", type=int, default=TOKENS,
                    help=f"tokens of context before the batch-1 decode (default {TOKENS})")
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from localpd.load.registry import resolve_model

        args.model = str(resolve_model("smollm2-135m").path)
    bin_dir = args.llama_bin or llama_bin()

    load = [os.getloadavg()[0]]
    rounds = []
    for i in range(args.repeats):
        llama = llama_round(bin_dir, args.model, args.threads, args.context)
        print(f"# round {i + 1}: llama.cpp decode {llama['decode']:.1f} tok/s", file=sys.stderr, flush=True)
        ours = localpd_round(args.model, args.threads, args.quant, context=args.context)
        print(f"# round {i + 1}: localpd decode {ours['decode']:.1f} tok/s", file=sys.stderr, flush=True)
        if args.int_prefill:
            ours["int"] = localpd_round(args.model, args.threads, args.quant, int_prefill=True)
        rounds.append((llama, ours))
        load.append(os.getloadavg()[0])

    dev = rounds[0][1]["device"]
    built = next((p.name for p in Path(bin_dir).resolve().parents if p.name.startswith("llama.cpp")), bin_dir)
    threads = f"{args.threads} thread" + "s" * (args.threads > 1)
    print(f"# {Path(args.model).name} ({rounds[0][0]['type']}) | {threads} | localpd --quant {rounds[0][1]['quant']} | "
          f"{built} | {dev['name']}, copy {dev['measured_bandwidth'] / 1e9:.1f} GB/s "
          f"({dev.get('measured_note') or dev['measured_source']})")
    busy = max(load) > 0.5 + args.threads
    print(f"# load average {min(load):.1f} to {max(load):.1f} on {os.cpu_count()} CPUs during the run"
          + (": other work shared the cores, so both sides' numbers are low and noisy" if busy else ""))
    head = ("round", "llama dec", "localpd dec", "ratio", "llama pp128", "localpd pp128", "ratio", "localpd dec x8",
            "x8 / llama dec", "localpd MBU")
    table = [head]

    def row(label, llama, ours):
        mbu = "—" if ours["mbu"] is None else f"{ours['mbu']:.0%}"
        return (label, f"{llama['decode']:.1f}", f"{ours['decode']:.1f}", f"{ours['decode'] / llama['decode']:.2f}",
                f"{llama['prefill']:.1f}", f"{ours['prefill']:.1f}", f"{ours['prefill'] / llama['prefill']:.2f}",
                f"{ours['decode8']:.1f}", x8_ratio(ours, llama), mbu)

    def x8_ratio(ours, llama):  # batch 8 after 128 tokens against llama.cpp's decode after as many
        return f"{ours['decode8'] / llama['decode']:.2f}" if args.context == TOKENS else "—"

    for i, (llama, ours) in enumerate(rounds):
        table.append(row(str(i + 1), llama, ours))
    if len(rounds) > 1:
        med = {k: statistics.median(r[0][k] for r in rounds) for k in ("decode", "prefill")}
        ours_med = {k: statistics.median(r[1][k] for r in rounds) for k in ("decode", "prefill", "decode8")}
        mbus = [r[1]["mbu"] for r in rounds if r[1]["mbu"] is not None]
        ours_med["mbu"] = statistics.median(mbus) if mbus else None
        table.append(row("median", med, ours_med))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    if args.int_prefill:
        ints = [r[1]["int"]["prefill"] for r in rounds]
        print("# localpd pp128 with prefill on the integer products: " + ", ".join(
            f"{v:.1f} ({v / r[1]['prefill']:.2f}x prefill's GEMM's, {v / r[0]['prefill']:.2f}x llama.cpp's)"
            for v, r in zip(ints, rounds)) + f"; median {statistics.median(ints):.1f}")
    print(f"# tok/s; dec: batch-1 decode of {TOKENS} tokens after {args.context} of context (llama.cpp's tg{TOKENS} at "
          f"-d {args.context}, localpd's after its {args.context}-token prompt); x8: localpd's 8 sequences together, "
          f"summed, after {TOKENS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
