"""Load benchmark of `localpd serve`: requests/s, TTFT and TPOT percentiles at several concurrency levels.

    python scripts/bench_server.py --url http://127.0.0.1:8000      # a running server
    python scripts/bench_server.py --model smollm2-135m              # starts one in-process on a free port

Each stream is a chat completion with a distinct prompt (no prefix-cache hits beyond the template), greedy;
TTFT is the time to the first content chunk, TPOT the mean gap between later chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, headers: dict) -> tuple[float, float, int]:
    body = {"messages": [{"role": "user", "content": f"Request {i}: write a few sentences about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, last, chunks = None, None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (chunks - 1) if chunks > 1 else float("nan")
    return ttft, tpot, chunks


async def level(url: str, concurrency: int, requests: int, max_tokens: int, headers: dict) -> dict:
    results = []
    queue = list(range(requests))
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one(client, url, i, max_tokens, headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    tpots = [r[1] for r in results if r[1] == r[1]]
    return {"concurrency": concurrency, "requests": len(results), "req_per_s": len(results) / wall,
            "tok_per_s": sum(r[2] for r in results) / wall,
            **{f"ttft_p{q}": pct(ttfts, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}": pct(tpots, q) for q in (50, 90, 99)}, "tpot_mean": statistics.fmean(tpots or [0])}


def start_server(model: str, ctx: int):
    import socket
    import threading

    import uvicorn

    from localpd.engine import Engine
    from localpd.api.app import create_app

    engine = Engine(model, max_context=ctx)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    url, engine = (args.url, None) if args.url else start_server(args.model, args.ctx)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    print(f"# {url}  {args.requests} requests per level, max_tokens {args.max_tokens}")
    print("| streams | req/s | tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        r = asyncio.run(level(url, c, max(args.requests, c), args.max_tokens, headers))
        ms = lambda k: f"{r[k] * 1000:.0f}"  # noqa: E731
        print(f"| {c} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {ms('ttft_p50')} / {ms('ttft_p90')} / "
              f"{ms('ttft_p99')} | {ms('tpot_p50')} / {ms('tpot_p90')} / {ms('tpot_p99')} |", flush=True)
    if engine is not None:
        engine.close()


if __name__ == "__main__":
    main()
