"""Prompt-lookup speculation, localpd against llama.cpp's n-gram speculative decoding on the CPU: the same GGUF file,
the same threads, the same prompts (scripts/bench_speculate.py's repeat, edit and story), greedy, in one run.

localpd decodes each prompt plainly and with `--speculate ngram` (one engine in this process, its replies checked
token for token against the plain ones); llama.cpp's llama-server decodes it with `--spec-type none` and with each
n-gram mode given (one server a mode, the prompt's cache kept between requests). The sides take turns by rounds
(localpd, then every llama.cpp mode, for --rounds rounds), since a shared machine's speed drifts; each number is
the median of its rounds' decode tok/s (llama.cpp's `timings.predicted_per_second`, localpd's `decode_tps`: both
the reply's tokens over the time after its first token). The table gives each mode's decode tok/s, its ratio to
its own side's plain decoding, and localpd's n-gram decode over each llama.cpp mode's.

    python scripts/bench_speculate_vs_llamacpp.py [--threads 2] [--rounds 3] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_vs_llamacpp import llama_bin  # noqa: E402
from bench_startup import free_port  # noqa: E402
from bench_speculate import PROMPTS, reply  # noqa: E402

from localpd.engine import Engine  # noqa: E402
from localpd.engine.speculate import SpeculateConfig  # noqa: E402
from localpd.load.registry import resolve_model  # noqa: E402

# llama-server's n-gram modes tried (label -> arguments): its defaults look up 12-token n-grams, which the replies
# here rarely repeat exactly; ngram-mod's defaults and a 3-token lookup of ngram-simple are its best on them
LLAMA_MODES = {
    "none": ["--spec-type", "none"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-simple 3/8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                         "--spec-ngram-simple-size-m", "8"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


def llama_mode(bin_dir: str, model: str, threads: int, args: list[str], max_tokens: int) -> dict:
    """One llama-server with these arguments: each prompt's decode tok/s (a first request fills its prompt cache)."""
    port = free_port()
    server = subprocess.Popen([str(Path(bin_dir) / "llama-server"), "-m", model, "-t", str(threads), "-c", "2048",
                               "-np", "1", "--port", str(port), "--no-webui", *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"llama-server {' '.join(args)} exited with {server.returncode}")
            time.sleep(0.2)
        out = {}
        for name, messages in PROMPTS.items():
            body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "cache_prompt": True}
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)  # the prompt's cache
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
            t = r["timings"]
            out[name] = (t["predicted_per_second"], r["usage"]["completion_tokens"], t.get("draft_n"),
                         t.get("draft_n_accepted"))
        return out
    finally:
        server.terminate()
        server.wait()


def localpd_round(engine: Engine, max_tokens: int) -> tuple[dict, bool]:
    """Each prompt's plain and n-gram decode tok/s and the n-gram reply's stats; whether every n-gram reply was
    the plain one."""
    out, same = {}, True
    for name, messages in PROMPTS.items():
        ids, stats, _ = reply(engine, messages, max_tokens, SpeculateConfig())
        sids, sstats, _ = reply(engine, messages, max_tokens, SpeculateConfig("ngram"))
        same &= sids == ids
        out[name] = (stats.decode_tps, sstats.decode_tps, len(ids), sstats.drafted_tokens, sstats.acceptance)
    return out, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a registry name or .gguf file both sides load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--llama-bin", help="folder holding llama-server (default: ../shared/peers/llama-cpp.sh's output)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(resolve_model(args.model, pull=True).path)
    if path.suffix != ".gguf":
        sys.exit(f"{args.model} is not a GGUF file: llama.cpp cannot load it")
    engine = Engine(str(path), device="cpu", max_context=2048)
    bin_dir = args.llama_bin or llama_bin()
    print(f"# {path} | {args.threads} threads | {args.rounds} rounds | {engine.path} | llama.cpp: {bin_dir}")
    for name, messages in PROMPTS.items():  # warm: the prompts' pages in localpd's prefix cache
        reply(engine, messages, args.max_tokens, SpeculateConfig())
    ours, theirs, identical = [], {mode: [] for mode in LLAMA_MODES}, True
    with torch.inference_mode():
        for _ in range(args.rounds):
            got, same = localpd_round(engine, args.max_tokens)
            ours.append(got)
            identical &= same
            for mode, extra in LLAMA_MODES.items():
                theirs[mode].append(llama_mode(bin_dir, str(path), args.threads, extra, args.max_tokens))
    engine.close()
    med = statistics.median
    for name in PROMPTS:
        plain, ngram = med(r[name][0] for r in ours), med(r[name][1] for r in ours)
        last = ours[-1][name]
        acc = f"{last[4]:.0%}" if last[4] is not None else "-"
        print(f"{name:7} localpd    plain {plain:6.1f} tok/s | ngram {ngram:6.1f} tok/s ({ngram / plain:.2f}x) | "
              f"reply {last[2]} tokens, drafted {last[3]}, kept {acc}")
        base = med(r[name][0] for r in theirs["none"])
        for mode in LLAMA_MODES:
            tps = med(r[name][0] for r in theirs[mode])
            _, tokens, drafted, kept = theirs[mode][-1][name]
            print(f"{'':7} llama.cpp  {mode:16} {tps:6.1f} tok/s ({tps / base:.2f}x its plain) | localpd ngram "
                  f"{ngram / tps:.2f}x | reply {tokens} tokens, drafted {drafted}, kept {kept}")
    print(f"localpd's n-gram replies identical to its plain ones: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
