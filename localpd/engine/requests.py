"""A request as the engine holds it, and what a front door gets back: a RequestHandle streaming TokenEvents, each
step's StepStats, the request's GenerationStats; the engine's EngineStats."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from localpd.engine.sampling import Sampler, SamplingParams
from localpd.engine.scheduler import Sequence
from localpd.engine.speculate import DraftState
from localpd.text.stops import StopMatcher
from localpd.text.tokenizer import IncrementalDetokenizer


@dataclass
class StepStats:
    phase: str  # "prefill", "decode" or "mixed"
    tokens: int  # tokens this step pushed through the model, all sequences together
    seconds: float  # the step's time on the device: CUDA events on a GPU, the wall clock on the CPU
    batch: int = 1  # sequences in the step
    bytes: int = 0  # weight and KV bytes the step moved (localpd.measure.roofline.step_cost)
    flops: int = 0
    wall_seconds: float = 0.0  # the step on the host's clock, Python and sampling included
    drafted: int = 0  # drafted tokens the step verified (engine.speculate), all sequences together
    accepted: int = 0  # of those, the ones the model confirmed
    passes: int = 1  # passes over the weights: a chain's decode steps (engine.cuda_graph.DecodeGraphs.run_chain)

    @property
    def written(self) -> int:
        """Tokens the step added to its sequences' texts or prompts: each drafted sequence its own token, the
        confirmed drafted ones and the one sampled after them."""
        return self.tokens - self.drafted + self.accepted


@dataclass
class TokenEvent:
    token_id: int | None  # None on a final event that carries no new token
    text: str  # the new text, UTF-8 safe, stop strings removed
    finish_reason: str | None = None  # None while running; "stop", "length", "cancelled" or "error"
    stats: StepStats | None = None
    logprob: float | None = None  # of the chosen token, when SamplingParams.logprobs is set
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    embedding: list[float] | None = None  # an embedding request's one (final) event: its vector (Engine.embed)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    prefill_seconds: float = 0.0  # from submission to the first token (queueing included)
    output_tokens: int = 0
    decode_seconds: float = 0.0  # from the first token to the last
    decode_step_seconds: float = 0.0  # time of the steps that produced tokens 2..n
    decode_bytes: int = 0  # bytes those steps moved
    decode_steps: int = 0  # the steps that wrote tokens 2..n (passes over the weights)
    decode_written: int = 0  # tokens those steps wrote, an end-of-sequence token included
    drafted_tokens: int = 0  # drafted tokens verified for this request (engine.speculate)
    accepted_tokens: int = 0  # of those, the ones the model confirmed
    bytes_moved: int = 0  # bytes of every step this request took part in
    finish_reason: str | None = None
    # the steps that computed the prompt, each chunk of it (only the last one samples, so only it reaches an event):
    # what a benchmark sums for the prefill's time and FLOPs
    prefill_steps: list[StepStats] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.prefill_seconds

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        """Share of the drafted tokens the model confirmed (None: nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_pass(self) -> float:
        """Tokens written per decode step (one pass over the weights each): 1 without speculation."""
        return self.decode_written / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.output_tokens - 1  # the first token comes out of prefill
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else 0.0


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    kv_pages_cached: int  # pages holding prefix-cache entries (referenced or not)
    kv_dtype: str
    page_size: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    preemptions: int
    weight_bytes: int
    max_running: int


class RequestHandle:
    """One request's event stream, readable from a thread (iterate) or from asyncio (async for)."""

    def __init__(self, request_id: str, prompt_tokens: int, engine):
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.finished = False
        self._engine = engine
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[TokenEvent] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue | None = None

    def cancel(self) -> None:
        """Stop the request; its pages are released at the engine's next step. Safe from any thread."""
        if not self.finished:
            self._engine._cancel(self)

    def _push(self, event: TokenEvent) -> None:
        with self._lock:
            if event.finish_reason is not None:
                self.finished = True
            if self._loop is None:
                self._events.append(event)
                self._ready.notify_all()
                return
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, event)
            except RuntimeError:  # the listener's event loop is gone
                pass

    def __iter__(self) -> Iterator[TokenEvent]:
        done = False
        try:
            while not done:
                with self._lock:
                    while not self._events:
                        self._ready.wait()
                    event = self._events.popleft()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:  # the consumer walked away: free the request's pages
                self.cancel()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[TokenEvent]:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._aqueue = asyncio.Queue()
            while self._events:
                self._aqueue.put_nowait(self._events.popleft())
        done = False
        try:
            while not done:
                event = await self._aqueue.get()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel()


@dataclass(eq=False)
class Request:
    seq: Sequence
    handle: RequestHandle
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer | None
    stops: StopMatcher
    eos: set[int]
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    embed: bool = False  # ends after its prompt with the last position's hidden state instead of a token
    draft: DraftState = field(default_factory=DraftState)  # its speculative decoding (engine.speculate)
