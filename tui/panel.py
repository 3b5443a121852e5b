"""The live bandwidth panel: how close each token came to the device's ceilings, from the engine's own step
accounting. Only measured numbers are shown; what is not known is a dash."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from localpd.measure.device import DeviceInfo, fits_in_cache
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle, StepStats, TokenEvent
from localpd.measure.roofline import decode_ceiling_tps, utilisation


@dataclass
class PanelData:
    """What the panel shows for the current (or last) reply."""

    token_gbs: list[float] = field(default_factory=list)  # per decode token: step bytes / step seconds, GB/s
    last_gbs: float | None = None
    pct_peak: float | None = None  # of the datasheet bandwidth
    pct_measured: float | None = None
    decode_tps: float | None = None
    ceiling_tps: float | None = None
    ttft: float | None = None
    prefill_mfu: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    prefill_point: tuple[float, float] | None = None  # (FLOP/byte, FLOP/s)
    decode_point: tuple[float, float] | None = None
    decode_bytes: int = 0
    decode_flops: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    last_step: StepStats | None = None  # a verified draft writes several tokens (events) in one step, counted once
    acceptance: float | None = None  # speculative decoding: drafted tokens the model confirmed
    tokens_per_pass: float | None = None

    def add_token(self, event: TokenEvent, handle: RequestHandle, engine: Engine, info: DeviceInfo | None) -> None:
        step = event.stats
        if step is None:
            return
        s = handle.stats
        self.prompt_tokens, self.cached_tokens = s.prompt_tokens, s.cached_tokens
        if step.phase != "decode":
            self.ttft = s.ttft
            self.prefill_mfu = utilisation(step.flops, step.seconds, info.peak_flops if info else None)
            if step.bytes and step.seconds:
                self.prefill_point = (step.flops / step.bytes, step.flops / step.seconds)
            return
        self.decode_tokens += 1
        if step is self.last_step:  # another token of the same step
            self.decode_tps = self.decode_tokens / self.decode_seconds
            return
        self.last_step = step
        self.acceptance, self.tokens_per_pass = s.acceptance, s.tokens_per_pass or None
        gbs = step.bytes / step.seconds / 1e9
        self.token_gbs.append(gbs)
        self.last_gbs = gbs
        self.decode_bytes += step.bytes
        self.decode_flops += step.flops
        self.decode_seconds += step.seconds
        self.decode_tps = self.decode_tokens / self.decode_seconds
        self.decode_point = (self.decode_flops / self.decode_bytes, self.decode_flops / self.decode_seconds)
        if info is not None:
            self.pct_peak = utilisation(step.bytes, step.seconds, info.peak_bandwidth)
            self.pct_measured = utilisation(step.bytes, step.seconds, info.measured_bandwidth)
            if info.bandwidth:
                context = s.prompt_tokens + s.output_tokens
                self.ceiling_tps = decode_ceiling_tps(engine.model, context, engine.kv_traffic, info.bandwidth)


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def num(x: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{unit}"


def cache_lines(weight_bytes: int, info: DeviceInfo | None) -> list[str]:
    """Where the weights fit in the last-level cache, the panel says so: a share of the measured (DRAM) ceiling
    over 100% is then the cache's doing, not an error."""
    if not fits_in_cache(weight_bytes, info):
        return []
    return [f"LLC      {info.llc_bytes / 2**20:.0f} MiB: weights fit,",
            "         served from cache, so",
            "         MBU may pass 100%"]


def roofline_chart(data: PanelData, info: DeviceInfo | None, width: int = 26, height: int = 7) -> str:
    """A log-log text chart: the bandwidth roof as dots, P and D for the last prefill and decode points."""
    points = [p for p in (data.prefill_point, data.decode_point) if p]
    if not points or info is None or not info.bandwidth:
        return "roofline: waiting for a reply"
    xs = [math.log10(max(p[0], 1e-3)) for p in points]
    ys = [math.log10(max(p[1], 1.0)) for p in points]
    x0, x1 = min(xs + [-1.0]) - 0.5, max(xs + [3.0]) + 0.5
    roof_y = [math.log10(info.bandwidth) + x for x in (x0, x1)]
    if info.peak_flops:
        roof_y = [min(y, math.log10(info.peak_flops)) for y in roof_y]
    y0, y1 = min(ys) - 1, max(ys + roof_y) + 0.3
    grid = [[" "] * width for _ in range(height)]

    def put(x, y, ch):
        col = round((x - x0) / (x1 - x0) * (width - 1))
        row = height - 1 - round((y - y0) / (y1 - y0) * (height - 1))
        if 0 <= col < width and 0 <= row < height:
            grid[row][col] = ch

    for i in range(width):
        x = x0 + (x1 - x0) * i / (width - 1)
        y = math.log10(info.bandwidth) + x
        if info.peak_flops:
            y = min(y, math.log10(info.peak_flops))
        put(x, y, "·")
    for (x, y), ch in zip(zip(xs, ys), "PD" if data.prefill_point else "D"):
        put(x, y, ch)
    return "\n".join("".join(r) for r in grid) + "\nFLOP/byte → · roof P prefill D decode"


class BandwidthPanel(Vertical):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.data = PanelData()
        self.engine: Engine | None = None
        self.info: DeviceInfo | None = None

    def compose(self) -> ComposeResult:
        yield Static("bandwidth", classes="panel-title")
        yield Sparkline([], id="spark")
        yield Static(id="numbers")
        yield Static(id="chart")

    def start_reply(self) -> None:
        self.data = PanelData()
        self.show()

    def add_token(self, event: TokenEvent, handle: RequestHandle) -> None:
        if self.engine is not None:
            self.data.add_token(event, handle, self.engine, self.info)
        self.show()

    def show(self) -> None:
        d, e, info = self.data, self.engine, self.info
        self.query_one("#spark", Sparkline).data = d.token_gbs[-60:] or [0.0]
        lines = [f"device   {info.name if info else '—'}"]
        if e is not None:
            s = e.stats()
            lines.append(f"weights  {e.quant}, {e.model.weight_bytes / 2**20:.0f} MiB/token")
            lines += cache_lines(e.model.weight_bytes, info)
            lines.append(f"KV       {s.kv_pages_used}/{s.kv_pages_total} pages, {s.kv_dtype}")
        lines += [
            f"token    {num(d.last_gbs, '.1f', ' GB/s')}",
            f"         {pct(d.pct_measured)} measured, {pct(d.pct_peak)} peak",
            f"decode   {num(d.decode_tps, '.1f', ' tok/s')}",
            f"ceiling  {num(d.ceiling_tps, '.0f', ' tok/s')}",
            *([f"draft    {pct(d.acceptance)} accepted, {num(d.tokens_per_pass, '.2f', ' tok/pass')}"]
              if d.acceptance is not None else []),  # speculative decoding
            f"TTFT     {num(None if d.ttft is None else d.ttft * 1000, '.0f', ' ms')}, MFU {pct(d.prefill_mfu)}",
            f"cached   {d.cached_tokens}/{d.prompt_tokens} prompt tokens",
        ]
        self.query_one("#numbers", Static).update("\n".join(lines))
        self.query_one("#chart", Static).update(roofline_chart(d, info))
