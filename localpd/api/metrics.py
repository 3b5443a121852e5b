"""The server's Prometheus metrics on prometheus_client: requests by model and finish reason, tokens,
time-to-first-token and time-per-token histograms, the last decode MBU, speculative decoding's drafted and accepted
tokens beside the decode steps and their tokens, and the engine's queue, KV pages and prefix cache of each loaded
model (read from its engine as /metrics is scraped), every series labelled by model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from localpd.engine import Engine
from localpd.engine.requests import RequestHandle

disable_created_metrics()  # no *_created series beside each counter and histogram: the exposition as it was
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
ENGINE_SERIES = (  # name, EngineStats field, counter (else a gauge), help
    ("requests_running", "running", False, "requests in the running batch"),
    ("requests_running_max", "max_running", False, "the most requests the engine runs at once"),
    ("requests_waiting", "waiting", False, "requests queued for admission"),
    ("kv_pages_used", "kv_pages_used", False, "KV pages held by requests"),
    ("kv_pages_total", "kv_pages_total", False, "KV pages in the pool"),
    ("prefix_cache_hit_tokens_total", "prefix_hit_tokens", True, "prompt tokens served by the prefix cache"),
    ("prefix_cache_query_tokens_total", "prefix_query_tokens", True, "prompt tokens looked up in it"),
    ("preemptions_total", "preemptions", True, "requests preempted (recomputed later)"))


class EngineCollector:
    """The loaded engines' own counters and gauges, labelled by model, read at each scrape."""

    def __init__(self):
        self.engines: dict[str, Engine] = {}

    def collect(self):
        stats = {name: e.stats() for name, e in self.engines.items()}
        if not stats:
            return
        for name, field, counter, doc in ENGINE_SERIES:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(f"localpd_{name}", doc, labels=["model"])
            for model, s in stats.items():
                family.add_metric([model], getattr(s, field))
            yield family


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("localpd_time_to_first_token_seconds", "time to the first token", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("localpd_time_per_output_token_seconds", "time per token after the first", ["model"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.requests = Counter("localpd_requests", "requests ended", ["finish_reason", "model"], registry=r)
        self.prompt_tokens = Counter("localpd_prompt_tokens", "prompt tokens of ended requests", ["model"], registry=r)
        self.generation_tokens = Counter("localpd_generation_tokens", "tokens generated", ["model"], registry=r)
        self.mbu = Gauge("localpd_decode_mbu", "the last decode's memory bandwidth utilisation", ["model"], registry=r)
        # speculative decoding: acceptance = accepted / drafted, tokens per weight pass = decode tokens / decode steps
        self.drafted = Counter("localpd_draft_tokens", "drafted tokens verified", ["model"], registry=r)
        self.accepted = Counter("localpd_draft_accepted_tokens", "drafted tokens the model confirmed", ["model"],
                                registry=r)
        self.decode_steps = Counter("localpd_decode_steps", "decode steps (passes over the weights)", ["model"],
                                    registry=r)
        self.decode_tokens = Counter("localpd_decode_tokens", "tokens those steps wrote", ["model"], registry=r)
        self.engine = EngineCollector()
        r.register(self.engine)

    def record(self, handle: RequestHandle, mbu: float | None, model: str = "") -> None:
        s = handle.stats
        reason = s.finish_reason or "cancelled"  # recorded as the cancel is sent, before the engine ends it
        self.requests.labels(reason, model).inc()
        self.prompt_tokens.labels(model).inc(s.prompt_tokens)
        self.generation_tokens.labels(model).inc(s.output_tokens)
        self.drafted.labels(model).inc(s.drafted_tokens)
        self.accepted.labels(model).inc(s.accepted_tokens)
        self.decode_steps.labels(model).inc(s.decode_steps)
        self.decode_tokens.labels(model).inc(s.decode_written)
        if s.output_tokens:
            self.ttft.labels(model).observe(s.ttft)
        if s.output_tokens > 1:
            self.tpot.labels(model).observe(s.decode_seconds / (s.output_tokens - 1))
        if mbu is not None:
            self.mbu.labels(model).set(round(mbu, 4))

    def render(self, engines: dict[str, Engine]) -> bytes:
        """The exposition, with the series of the engines loaded now (model name -> engine)."""
        self.engine.engines = engines
        return generate_latest(self.registry)
