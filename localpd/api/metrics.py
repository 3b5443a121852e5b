"""The server's Prometheus metrics: requests by finish reason, tokens, time-to-first-token and time-per-token
histograms, the last decode MBU, and the engine's queue, KV pages and prefix cache."""

from __future__ import annotations

import threading

from localpd.engine import Engine
from localpd.engine.requests import RequestHandle

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)
        self.requests = {}  # finish reason -> count
        self.prompt_tokens = self.generation_tokens = 0
        self.last_mbu: float | None = None

    def record(self, handle: RequestHandle, mbu: float | None) -> None:
        s = handle.stats
        reason = s.finish_reason or "cancelled"  # recorded as the cancel is sent, before the engine ends it
        with self.lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += s.prompt_tokens
            self.generation_tokens += s.output_tokens
            if s.output_tokens:
                self.ttft.observe(s.ttft)
            if s.output_tokens > 1:
                self.tpot.observe(s.decode_seconds / (s.output_tokens - 1))
            if mbu is not None:
                self.last_mbu = mbu

    def render(self, engine: Engine | None) -> str:
        with self.lock:
            lines = self.ttft.lines("localpd_time_to_first_token_seconds")
            lines += self.tpot.lines("localpd_time_per_output_token_seconds")
            lines.append("# TYPE localpd_requests_total counter")
            lines += [f'localpd_requests_total{{finish_reason="{k}"}} {v}' for k, v in self.requests.items()]
            lines += ["# TYPE localpd_prompt_tokens_total counter", f"localpd_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE localpd_generation_tokens_total counter",
                      f"localpd_generation_tokens_total {self.generation_tokens}"]
            if self.last_mbu is not None:
                lines += ["# TYPE localpd_decode_mbu gauge", f"localpd_decode_mbu {self.last_mbu:.4f}"]
        if engine is not None:
            s = engine.stats()
            for name, value in (("requests_running", s.running), ("requests_running_max", s.max_running),
                                ("requests_waiting", s.waiting),
                                ("kv_pages_used", s.kv_pages_used), ("kv_pages_total", s.kv_pages_total),
                                ("prefix_cache_hit_tokens_total", s.prefix_hit_tokens),
                                ("prefix_cache_query_tokens_total", s.prefix_query_tokens),
                                ("preemptions_total", s.preemptions)):
                kind = "counter" if name.endswith("_total") else "gauge"
                lines += [f"# TYPE localpd_{name} {kind}", f"localpd_{name} {value}"]
        return "\n".join(lines) + "\n"
