"""Two models behind one `localpd serve` process (issue 29), on the CPU:

1. pace: the time per output token (TPOT) of N concurrent streams to model A, alone and while model B loads in the
   same process (what the client sees: the gaps between a stream's tokens, over the window the load takes), and
   their ratio. The server has B unloaded with keep_alive 0 after each load, so each round loads it anew.
2. cycles: B loaded and unloaded --cycles times (a request with keep_alive 0 each), the server's resident memory
   (VmRSS) before and after.

    python scripts/bench_multi_model.py A.gguf B.gguf [--streams 8] [--rounds 3] [--cycles 50]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


BEFORE = 4.0  # seconds the streams run alone before B starts loading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(models: list[str], ctx: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "localpd.cli", "serve", *models, "--port", str(port), "--ctx", str(ctx),
           "--keep-alive", "-1"] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(proc.stderr.read())
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not come up")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Stream(threading.Thread):
    """One streamed completion; the arrival time of each of its tokens."""

    def __init__(self, url: str, model: str, tokens: int):
        super().__init__(daemon=True)
        self.url, self.model, self.tokens = url, model, tokens
        self.times: list[float] = []

    def run(self):
        body = {"model": self.model, "prompt": "Rivers", "max_tokens": self.tokens, "min_tokens": self.tokens,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())


def gaps(streams: list[Stream], windows: list[tuple[float, float]]) -> list[float]:
    """The gaps between consecutive tokens of each stream that lie inside one of the windows."""
    return [b - a for s in streams for a, b in zip(s.times, s.times[1:])
            if any(start <= a and b <= end for start, end in windows)]


def load(url: str, model: str) -> tuple[float, float]:
    """B loaded (Ollama's load request, nothing to answer) and unloaded again as the request ends."""
    t0 = time.monotonic()
    r = httpx.post(url + "/api/generate", json={"model": model, "keep_alive": 0}, timeout=600)
    r.raise_for_status()
    return t0, time.monotonic()


def pace(url: str, a: str, b: str, n: int, tokens: int) -> dict:
    """One round: n streams to A, B loading in their middle. The streams' time per output token (the mean gap
    between a stream's tokens) and their longest gap, over the load's window and over the windows before and after
    it (every stream past its prefill, none finished)."""
    streams = [Stream(url, a, tokens) for _ in range(n)]
    for s in streams:
        s.start()
    while any(len(s.times) < 3 for s in streams):
        time.sleep(0.05)
    time.sleep(BEFORE)
    t0, t1 = load(url, b)
    for s in streams:
        s.join()
    first, last = max(s.times[2] for s in streams), min(s.times[-1] for s in streams)
    if last < t1 + 1.0:
        raise SystemExit(f"the streams ended before B had loaded: raise --tokens (now {tokens})")
    alone, loading = gaps(streams, [(first, t0), (t1, last)]), gaps(streams, [(t0, t1)])
    return {"tpot_alone_ms": statistics.mean(alone) * 1e3, "tpot_loading_ms": statistics.mean(loading) * 1e3,
            "longest_gap_alone_ms": max(alone) * 1e3, "longest_gap_loading_ms": max(loading) * 1e3,
            "load_s": t1 - t0, "ratio": statistics.mean(loading) / statistics.mean(alone)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="the model the streams go to (loaded at start)")
    ap.add_argument("b", help="the model loaded while they run")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400, help="tokens each stream generates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=50, help="load/unload cycles of B for the memory check (0: none)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    proc, url = start([args.a, args.b], args.ctx, args.threads)
    a, b = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    out: dict = {"a": a, "b": b, "streams": args.streams}
    try:
        out["rounds"] = rounds = [pace(url, a, b, args.streams, args.tokens) for _ in range(args.rounds)]
        for r in rounds:
            print(f"TPOT of {args.streams} streams to {a}: alone {r['tpot_alone_ms']:.1f} ms (longest gap "
                  f"{r['longest_gap_alone_ms']:.0f} ms), while {b} loads ({r['load_s']:.1f} s) "
                  f"{r['tpot_loading_ms']:.1f} ms (longest gap {r['longest_gap_loading_ms']:.0f} ms): "
                  f"{r['ratio']:.2f}x")
        if rounds:
            print(f"median ratio {statistics.median(r['ratio'] for r in rounds):.2f}x over {len(rounds)} rounds")
        if args.cycles:
            load(url, b)  # the first load's one-time costs (imports, kernels' library) before the baseline
            before = rss(proc.pid)
            seconds = []
            for i in range(args.cycles):
                t0, t1 = load(url, b)
                seconds.append(t1 - t0)
            time.sleep(1.0)  # the unload thread frees the last one
            after = rss(proc.pid)
            loaded = [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]
            print(f"{args.cycles} load/unload cycles of {b} ({statistics.median(seconds):.1f} s each): server RSS "
                  f"{before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after ({(after - before) / 2**20:+.0f} "
                  f"MiB, {after / before:.3f}x); loaded now: {loaded}")
            out["cycles"] = {"n": args.cycles, "rss_before": before, "rss_after": after, "load_s": seconds}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
