"""The engine: one model, its tokenizer, and generation as a stream of TokenEvents.

Front doors (chat, tui, server) never touch tensors: they hand the engine token ids or chat messages and
consume TokenEvents. A Conversation keeps its KV cache between turns, so a later turn prefills only the
tokens that differ from what is already cached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from localpd.errors import LocalpdError
from localpd.loader import load_model
from localpd.model import KVCache, Transformer
from localpd.registry import resolve_model
from localpd.sampling import Sampler, SamplingParams
from localpd.schemes import check_scheme, compute_dtype
from localpd.stops import StopMatcher
from localpd.tokenizer import IncrementalDetokenizer, Tokenizer

PREFILL_CHUNK = 512  # prompt tokens per prefill call: bounds the attention scores' memory


@dataclass
class StepStats:
    phase: str  # "prefill" or "decode"
    tokens: int  # tokens this step pushed through the model
    seconds: float


@dataclass
class TokenEvent:
    token_id: int | None  # None on the final event of a stream that ended without a new token
    text: str  # the new text, UTF-8 safe, stop strings removed
    finish_reason: str | None = None  # "stop", "length" or None while running
    stats: StepStats | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was already in the cache
    prefill_seconds: float = 0.0  # prompt processing up to the first sampled token
    output_tokens: int = 0
    decode_seconds: float = 0.0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.prefill_seconds

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.output_tokens - 1  # the first token comes out of prefill
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else 0.0


@dataclass
class Conversation:
    """A KV cache kept across turns, and the token ids whose keys and values it holds."""

    cache: KVCache
    ids: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.cache.length = 0
        self.ids = []


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Engine:
    def __init__(self, model: str | Path = "smollm2-135m", device: str | None = None, quant: str | None = None,
                 max_context: int | None = None, progress: bool = False):
        """quant: a weight scheme (localpd.schemes.SCHEMES). By default the file's own format on a GPU
        ("native"), and float32 on the CPU, where there are no quantized kernels and dense weights run fastest."""
        self.device = torch.device(device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LocalpdError("--device cuda asked for, but torch sees no CUDA GPU")
        self.quant = check_scheme(quant or ("fp32" if self.device.type == "cpu" else "native"))
        self.resolved = resolve_model(str(model), pull=True, progress=progress)
        loaded = load_model(self.resolved.path, dtype=compute_dtype(self.quant, self.device), device=self.device,
                            scheme=self.quant)
        self.config = loaded.config
        self.tokenizer = (Tokenizer.from_gguf_metadata(loaded.gguf.metadata) if loaded.gguf is not None
                          else Tokenizer.from_dir(loaded.hf_dir))
        self.model = Transformer(loaded.config, loaded.weights)
        self.max_context = min(max_context or self.config.max_context, self.config.max_context)
        if self.max_context < 2:
            raise LocalpdError(f"context length must be at least 2, got {self.max_context}")
        self.name = self.resolved.name
        self.last_stats = GenerationStats()

    def new_conversation(self) -> Conversation:
        return Conversation(self.model.new_cache(self.max_context))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_bos=False)

    def chat(self, messages: list[dict], params: SamplingParams,
             conversation: Conversation | None = None) -> Iterator[TokenEvent]:
        return self.generate(self.encode_chat(messages), params, conversation)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 conversation: Conversation | None = None) -> Iterator[TokenEvent]:
        """Stream the reply to prompt_ids. Checks the input before the first event is produced."""
        params.validate()
        if not prompt_ids:
            raise LocalpdError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise LocalpdError(f"the prompt has {len(prompt_ids)} tokens, more than the context of "
                               f"{self.max_context} allows (leave room for at least one reply token)")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise LocalpdError(f"token id {bad[0]} is outside the vocabulary of {self.config.vocab_size}")
        return self._stream(list(prompt_ids), params, conversation or self.new_conversation())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stream(self, prompt: list[int], params: SamplingParams, conv: Conversation) -> Iterator[TokenEvent]:
        cache = conv.cache
        reuse = min(common_prefix(conv.ids, prompt), len(prompt) - 1)
        cache.truncate(reuse)
        stats = GenerationStats(prompt_tokens=len(prompt), cached_tokens=reuse)
        self.last_stats = stats
        sampler = Sampler(params, device=self.device)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(params.stop)
        eos = set() if params.ignore_eos else self.tokenizer.eos_ids
        budget = min(params.max_tokens, self.max_context - len(prompt))
        output: list[int] = []
        try:
            t0 = time.perf_counter()
            for start in range(reuse, len(prompt), PREFILL_CHUNK):
                chunk = torch.tensor(prompt[start:start + PREFILL_CHUNK], device=self.device)
                logits = self.model.prefill(chunk, cache)
            conv.ids = prompt[:cache.length]
            phase, n_in = "prefill", len(prompt) - reuse
            while True:
                token = sampler(logits, prompt, output)
                self._sync()
                seconds = time.perf_counter() - t0
                step = StepStats(phase, n_in, seconds)
                if phase == "prefill":
                    stats.prefill_seconds = seconds
                else:
                    stats.decode_seconds += seconds
                if token in eos:
                    stats.finish_reason = "stop"
                    yield TokenEvent(None, stops.flush(detok.flush()), "stop", step)
                    return
                output.append(token)
                stats.output_tokens = len(output)
                text, hit = stops.push(detok.push(token))
                if hit:
                    stats.finish_reason = "stop"
                    yield TokenEvent(token, text, "stop", step)
                    return
                if len(output) >= budget:
                    stats.finish_reason = "length"
                    yield TokenEvent(token, text + stops.flush(detok.flush()), "length", step)
                    return
                yield TokenEvent(token, text, None, step)
                t0 = time.perf_counter()
                logits = self.model.decode(token, cache)
                conv.ids = (prompt + output)[:cache.length]
                phase, n_in = "decode", 1
        finally:
            conv.ids = (prompt + output)[:cache.length]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
