"""Start-up time: a one-shot `localpd chat` beside llama-server on the same GGUF file, the same threads.

    python scripts/bench_startup.py [MODEL] [--runs 5] [--threads 2] [--llama-bin DIR] [--json FILE]

(a) `localpd chat MODEL "Hi" --max-tokens 1`: from the process's start to the first byte of its reply on stdout
    (the first token) and to its exit.
(b) `llama-server -m FILE -t THREADS` on 127.0.0.1: from its start to the first successful reply of a
    /completion of one token (after /health answers 200); then it is stopped.
Runs alternate (localpd, llama-server, ...) after one untimed run of each (page cache, localpd's CPU kernels built
at first use). Prints min and median of each, their ratio, and each child's peak resident memory (ru_maxrss).
llama.cpp's tools come from ../shared/peers/llama-cpp.sh (relative to the repository root) or --llama-bin.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers" / "llama-cpp.sh"


def llama_bin(given: str | None) -> Path:
    if given:
        return Path(given)
    out = subprocess.run(["bash", str(PEERS)], capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def wait_child(p: subprocess.Popen) -> int:
    """Reap p and return its peak resident memory in KiB (Linux's ru_maxrss)."""
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss


def localpd_command(given: str | None) -> list[str]:
    if given:
        return shlex.split(given)
    exe = Path(sys.executable).with_name("localpd")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "localpd.cli"]


def run_localpd(cmd: list[str], model: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd + ["chat", model, "Hi", "--max-tokens", "1"], stdout=subprocess.PIPE,
                             stderr=err, env=env)
        first = p.stdout.read(1)  # the reply is flushed token by token
        t_first = time.perf_counter() - t0
        p.stdout.read()
        p.stdout.close()
        rss = wait_child(p)
        t_exit = time.perf_counter() - t0
        if p.returncode or not first:
            err.seek(0)
            raise SystemExit(f"localpd failed ({p.returncode}): {err.read().decode(errors='replace')[-2000:]}")
    return {"first": t_first, "exit": t_exit, "rss_kib": rss}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 30.0) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0  # not listening yet


def run_llama(server: Path, gguf: Path, threads: int, ctx: int, limit: float = 120.0) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(server), "-m", str(gguf), "-t", str(threads), "-c", str(ctx), "--host", "127.0.0.1",
           "--port", str(port)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while request(base + "/health", timeout=5) != 200:
            if p.poll() is not None or time.perf_counter() - t0 > limit:
                raise SystemExit(f"llama-server did not come up ({' '.join(cmd)})")
            time.sleep(0.005)
        status = request(base + "/completion", {"prompt": "Hi", "n_predict": 1})
        t_reply = time.perf_counter() - t0
        if status != 200:
            raise SystemExit(f"llama-server's /completion answered {status}")
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rss = wait_child(p)
        except ChildProcessError:  # reaped by poll() already
            rss = None
    return {"first": t_reply, "exit": None, "rss_kib": rss}


def summary(name: str, runs: list[dict]) -> dict:
    out = {"runs": runs}
    for key in ("first", "exit"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"min": min(values), "median": statistics.median(values)}
    rss = [r["rss_kib"] for r in runs if r["rss_kib"]]
    out["peak_rss_mib"] = max(rss) / 1024 if rss else None
    parts = [f"{name:<13}"]
    for key, label in (("first", "to first token"), ("exit", "to exit")):
        if key in out:
            parts.append(f"{label}: min {out[key]['min']:.3f} s, median {out[key]['median']:.3f} s")
    if out["peak_rss_mib"]:
        parts.append(f"peak RSS {out['peak_rss_mib']:.0f} MiB")
    print("  ".join(parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192, help="llama-server's -c (localpd chat's own default is 8192)")
    ap.add_argument("--llama-bin", help="folder holding llama-server (default: ../shared/peers/llama-cpp.sh's)")
    ap.add_argument("--localpd", help="the command that runs localpd (default: the localpd beside this python)")
    ap.add_argument("--json", help="write every run and the summary here")
    args = ap.parse_args()

    from localpd.load.registry import resolve_model

    gguf = resolve_model(args.model).path
    server = llama_bin(args.llama_bin) / "llama-server"
    if not shutil.which(str(server)):
        raise SystemExit(f"no llama-server at {server}")
    cmd = localpd_command(args.localpd)
    print(f"{args.model}: {gguf}, {args.threads} threads, {args.runs} runs each (after one untimed)")
    load = [os.getloadavg()[0]]
    run_localpd(cmd, args.model, args.threads), run_llama(server, gguf, args.threads, args.ctx)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(run_localpd(cmd, args.model, args.threads))
        theirs.append(run_llama(server, gguf, args.threads, args.ctx))
        load.append(os.getloadavg()[0])
    result = {"model": args.model, "file": str(gguf), "threads": args.threads, "load_1min": load,
              "localpd": summary("localpd chat", ours), "llama-server": summary("llama-server", theirs)}
    ratio = {k: result["localpd"]["first"][k] / result["llama-server"]["first"][k] for k in ("min", "median")}
    result["ratio"] = ratio
    print(f"ratio (localpd's first token / llama-server's first reply): min {ratio['min']:.2f}x, "
          f"median {ratio['median']:.2f}x")
    print(f"1-minute load average before and after each round: {', '.join(f'{x:.2f}' for x in load)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
