"""The engine: one model, a paged KV cache and a scheduler, running many requests at once on its own thread.

Front doors (chat, tui, server, bench) never touch tensors: they submit token ids or chat messages and consume a
RequestHandle's TokenEvents, from a plain thread or from asyncio. A request's prompt is matched against the
prefix cache first, so a repeated system prompt or the earlier turns of a chat are not computed again.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Iterator

import torch

from localpd.constrain.build import request_constraint
from localpd.constrain.grammar import Vocabulary
from localpd.constrain.tools import check_tools
from localpd.engine.output import OutputProcessor
from localpd.engine.requests import EngineStats, Request, RequestHandle, TokenEvent
from localpd.engine.runner import ModelRunner, argmax_only
from localpd.engine.sampling import Sampler, SamplingParams
from localpd.engine.scheduler import MAX_RUNNING, MAX_STEP_TOKENS, Scheduler, Sequence
from localpd.engine.draft_model import DraftModel, check_vocabulary, draft_token_bytes, new_draft_pool
from localpd.engine.speculate import SpeculateConfig, Speculator, allowed_prefix
from localpd.errors import LocalpdError
from localpd.kvcache.dispatch import per_page, rows_as_decode, verification_room
from localpd.kvcache.pages import PagePool
from localpd.load.loader import load_model
from localpd.load.registry import resolve_model
from localpd.model.transformer import Transformer
from localpd.kvcache.formats import KVTraffic, check_kv_dtype, kv_formats, new_kv_pool, same_kv
from localpd.quant.schemes import DENSE, check_scheme, compute_dtype, default_scheme, group_notes
from localpd.quant.store import is_quantized_dir
from localpd.text.prompt import chat_prompt_ids, check_messages
from localpd.text.stops import StopMatcher
from localpd.text.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("localpd.engine.engine")

PAGE_SIZE = 16
# decode steps a step chains on a GPU where every sequence decodes greedily (Engine._chain): the host's 0.1-0.3 ms
# between steps then comes once in 8 tokens (Llama-3-8B int4 on an H100: 363 -> 381 tok/s, docs/PERF.md); a reply
# that ends inside a chain computed up to 7 tokens for nothing. Not where a chain would take longer than
# CHAIN_SECONDS: a request that arrives meanwhile waits for the chain's end to start (a slow card's steps are long
# enough that the host's share is small anyway).
CHAIN_STEPS = 8
MAX_CHAIN = 64
CHAIN_SECONDS = 0.04

_open_engines: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    """An engine thread still inside a torch op while the interpreter shuts down aborts the process ("terminate
    called without an active exception"), so engines their owner did not close are closed here, each after its
    current step."""
    for engine in list(_open_engines):
        engine.close()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def kv_default(device: torch.device, quant: str, dtype: torch.dtype) -> str:
    """The KV cache's format where --kv does not say: the compute dtype's, except on the CPU's kernel path (a
    quantized scheme on localpd's CPU kernels, float32 activations), where float16 pages halve the bytes a decode
    step reads of the cache, as llama.cpp's default f16 cache does (perplexity of the default model 13.1749 with
    float32 pages, 13.1740 with float16). The reference path (a float scheme) keeps values as computed."""
    if device.type == "cpu" and dtype == torch.float32 and quant not in DENSE:
        from localpd.kernels import cpu

        lib = cpu.library()
        if lib is not None and lib.lpd_half_pages():
            return "fp16"
    return same_kv(dtype)


def parse_bytes(text: str | int | None) -> int | None:
    """'4GiB', '512MB', '2g', or a plain number of bytes."""
    if text is None or isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
             "g": 2**30, "gb": 10**9, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise LocalpdError(f"cannot read '{text}' as a size (examples: 2GiB, 512MB, 1000000)") from None


class Engine:
    def __init__(self, model: str | Path = "smollm2-135m", device: str | None = None, quant: str | None = None,
                 kv: str | None = None, max_context: int | None = None, kv_memory: str | int | None = None,
                 kv_tokens: int | None = None, progress: bool = False, max_step_tokens: int = MAX_STEP_TOKENS,
                 max_running: int = MAX_RUNNING, cuda_graphs: bool = True, speculate: SpeculateConfig | None = None,
                 draft: str | None = None, decode_chain: int | None = None):
        """quant: a weight scheme (localpd.quant.schemes.SCHEMES); by default the file's own format ("native"; on a
        CPU without localpd's CPU kernels, float32: schemes.default_scheme). kv: the KV cache dtype
        (localpd.kvcache.formats.KV_DTYPES); by default kv_default's. kv_memory: bytes for the KV cache, a draft
        model's pages included (default: most of the free GPU memory; on the CPU room for two full contexts); or
        kv_tokens: room for that many tokens. cuda_graphs: replay decode steps as CUDA
        graphs on a GPU (localpd.engine.cuda_graph). speculate: speculative decoding (localpd.engine.speculate; by
        default off). draft: a model of the same vocabulary that drafts for this one (engine.draft_model; speculate's
        mode "draft"). decode_chain: the decode steps one step may chain where every sequence decodes greedily
        (Engine._chain; by default CHAIN_STEPS on a GPU's graphs, else 1: off)."""
        self.device = torch.device(device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LocalpdError("--device cuda asked for, but torch sees no CUDA GPU")
        prequantized = is_quantized_dir(Path(str(model)))  # `localpd quantize` output: run as stored
        self.quant = check_scheme(quant or default_scheme(self.device, prequantized))
        self.compute_dtype = compute_dtype(self.quant, self.device)
        self.name, self.resolved, loaded = load(str(model), self.quant, self.compute_dtype, self.device, progress)
        self.config = loaded.config
        self.tokenizer: Tokenizer | None = loaded.tokenizer()
        self.notes = group_notes(loaded.weights, self.quant)  # how the scheme had to adapt to this model
        self.path = f"{self.device.type} path: weights {self.quant}"  # which kernels run, in words (--verbose)
        if self.device.type == "cpu":  # localpd's CPU kernels, or why the references run
            from localpd.kernels import cpu

            self.path = f"{cpu.describe()}; weights {self.quant}"
        self.max_context = min(max_context or self.config.max_context, self.config.max_context)
        if self.max_context < 2:
            raise LocalpdError(f"context length must be at least 2, got {self.max_context}")
        window = 0 if self.config.swa_layers else self.config.sliding_window  # Gemma's windows are per layer
        if window and max_context and max_context > window:
            self.notes.append(f"context capped at {window} tokens: the model attends within a window of that many, "
                              f"and localpd to the whole context, which is the same up to there")
        self.model = Transformer(loaded.config, loaded.weights, context=self.max_context, consume=True)
        default_kv = kv_default(self.device, self.quant, self.compute_dtype)
        self.kv_dtype = check_kv_dtype(kv or default_kv, self.device)
        c = self.config
        self.kv_traffic = KVTraffic(self.kv_dtype, c.n_layers, c.n_kv_heads, c.head_dim, PAGE_SIZE,
                                    self.compute_dtype.itemsize, len(c.swa_layers), c.sliding_window)
        # drafts only where a verification step's rows compute what plain decoding's steps would (not rounded pages
        # on a GPU): else the reply would no longer be plain decoding's
        self.drafts_allowed = rows_as_decode(kv_formats(self.kv_dtype), self.device)
        if draft and not self.drafts_allowed:
            raise LocalpdError(f"a draft model cannot draft under the {self.kv_dtype} KV cache on {self.device.type}: "
                               f"its rounded pages would let drafted rows change the reply")
        if draft and per_page(kv_formats(self.kv_dtype)):
            raise LocalpdError(f"a draft model cannot draft under the {self.kv_dtype} KV cache: the draft's own pages "
                               f"keep no stage for their open page (--speculate ngram can)")
        # the draft model before the pool is sized: its pages (one for each of the target's) share the budget
        drafting = self._load_draft(draft) if draft else None
        self.draft_token_bytes = 0 if drafting is None else draft_token_bytes(drafting[1], self.kv_dtype, PAGE_SIZE)
        if kv_tokens is not None and kv_memory is None:
            kv_memory = -(-max(kv_tokens, self.max_context + 1) // PAGE_SIZE) * PAGE_SIZE * self.kv_token_bytes
        n_pages = self._kv_pages(parse_bytes(kv_memory))
        graphs = cuda_graphs and self.device.type == "cuda"
        self.decode_chain = (CHAIN_STEPS if graphs else 1) if decode_chain is None else decode_chain
        if not 1 <= self.decode_chain <= MAX_CHAIN:
            raise LocalpdError(f"decode_chain must be 1 to {MAX_CHAIN} steps, got {self.decode_chain}")
        padded = graphs or self.decode_chain > 1  # decode steps from DecodeGraphs' static inputs
        # with those, one more page than the allocator hands out: the scratch page of padded decode rows
        # and one more stage row than running sequences: the scratch row of padded decode rows
        self.kv = new_kv_pool(self.kv_dtype, c.n_layers, n_pages + padded, PAGE_SIZE, c.n_kv_heads, c.head_dim,
                              self.compute_dtype, self.device, stage_rows=max_running + padded)
        self.graphs = None
        self.drafter = None
        if drafting is not None:
            name, model, dtype = drafting
            self.drafter = DraftModel(name, model, new_draft_pool(model, self.kv, self.kv_dtype, dtype, self.device),
                                      model.weight_bytes / self.model.weight_bytes)
        chain = None
        if padded:  # a draft model replays its decode steps too, on graphs of its own over its pool
            from localpd.engine.cuda_graph import DecodeGraphs

            max_pages, max_batch = -(-(self.max_context + 1) // PAGE_SIZE), min(max_running, 64)
            chain = DecodeGraphs(self.model, self.kv, max_pages, n_pages, max_running, max_batch, self.decode_chain)
            self.graphs = chain if graphs else None  # on the CPU, only chains run from the static inputs
            if graphs and self.drafter is not None:
                self.drafter.graphs = DecodeGraphs(self.drafter.model, self.drafter.kv, max_pages, n_pages, 0,
                                                   max_batch)
        self.pages = PagePool(n_pages, PAGE_SIZE, salt=f"{self.name}|{self.quant}|{self.kv_dtype}")
        self.scheduler = Scheduler(self.pages, max_step_tokens, max_running)
        self.runner = ModelRunner(self.model, self.kv, self.kv_traffic, self.scheduler, self.graphs, self.device,
                                  self.drafter, chain if self.decode_chain > 1 else None)
        self.output = OutputProcessor(self._finish)
        self.speculator = self._speculator(speculate or SpeculateConfig())
        if self.speculator.config.on and not self.drafts_allowed:
            self.notes.append(f"speculative decoding is off under the {self.kv_dtype} KV cache: its rounded pages "
                              f"would let drafted rows change the reply")
        self._requests: dict[Sequence, Request] = {}
        self._pass_seconds = 0.0  # the last decode step's device time a pass over the weights (Engine._chain)
        self._inbox: deque[Request] = deque()
        self._cancels: set[RequestHandle] = set()
        self._wake = threading.Condition()
        self._closed = False
        self._ids = itertools.count()
        self._vocabulary: Vocabulary | None = None  # llguidance's view of the tokenizer, built at the first constraint
        self._thread = threading.Thread(target=self._run, name="localpd-engine", daemon=True)
        self._thread.start()
        _open_engines.add(self)

    def _load_draft(self, draft: str) -> tuple[str, Transformer, torch.dtype]:
        """The draft model in its file's own scheme (engine.draft_model): its name, model and compute dtype; a
        one-line error where its vocabulary is not the target's."""
        quant = default_scheme(self.device, is_quantized_dir(Path(draft)))
        dtype = compute_dtype(quant, self.device)
        name, _, loaded = load(draft, quant, dtype, self.device, False)
        check_vocabulary(loaded.tokenizer(), self.tokenizer, loaded.config.vocab_size, self.config.vocab_size, name)
        return name, Transformer(loaded.config, loaded.weights, context=self.max_context, consume=True), dtype

    @property
    def kv_token_bytes(self) -> int:
        """Storage bytes of one token's keys and values over all layers, a draft model's too (what sizes the pool:
        --kv-memory holds both)."""
        return self.kv_traffic.per_token + self.draft_token_bytes

    def _kv_pages(self, kv_memory: int | None) -> int:
        page_bytes = self.kv_token_bytes * PAGE_SIZE
        need = -(-(self.max_context + 1) // PAGE_SIZE)  # one full context must fit
        if kv_memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_memory = int(free * 0.9) - (1 << 30)  # leave room for activations and the allocator
            else:
                kv_memory = 2 * need * page_bytes
        pages = kv_memory // page_bytes
        if pages < need:
            both = ", the draft model's included" if self.draft_token_bytes else ""
            raise LocalpdError(
                f"the KV cache budget ({kv_memory / 2**20:.0f} MiB, {pages} pages) does not hold one context of "
                f"{self.max_context} tokens ({need} pages of {page_bytes / 2**10:.0f} KiB in {self.kv_dtype}{both}); "
                f"lower --ctx or raise --kv-memory")
        return int(pages)

    # -- front-door API ----------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_vars: dict | None = None, tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
        """Token ids of a conversation in the model's chat template (localpd.text.prompt.chat_prompt_ids, which
        says what the options do); tools are checked first (localpd.constrain.tools)."""
        if self.tokenizer is None:
            raise LocalpdError(f"{self.name} has no tokenizer")
        check_messages(messages)
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, template_vars,
                               check_tools(tools) if tools else None, continue_final)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               embed: bool = False) -> RequestHandle:
        """Queue a request; the checks run here, so bad input raises before any event. embed: see Engine.embed."""
        params.validate()
        if not prompt_ids:
            raise LocalpdError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise LocalpdError(f"the prompt has {len(prompt_ids)} tokens, more than the context of "
                               f"{self.max_context} allows (leave room for at least one reply token)")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
        if bad:
            raise LocalpdError(f"token id {bad[0]} is outside the vocabulary of {self.config.vocab_size}")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.config.vocab_size)]
            if bad:
                raise LocalpdError(f"{name} names token id {bad[0]}, outside the vocabulary of "
                                   f"{self.config.vocab_size}", param=name)
        if self._closed:
            raise LocalpdError("the engine is closed")
        prompt = list(prompt_ids)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(rid, len(prompt), self)
        budget = min(params.max_tokens, self.max_context - len(prompt))
        eos = set() if params.ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        eos |= set(params.stop_token_ids)
        req = Request(
            seq=Sequence(rid, prompt, budget), handle=handle, params=params,
            sampler=Sampler(params, device=self.device, constraint=request_constraint(
                params, self.tokenizer, self._vocabulary_once, eos, prompt, self.name)),
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            stops=StopMatcher(params.stop), eos=eos, embed=embed,
        )
        with self._wake:
            self._inbox.append(req)
            self._wake.notify()
        return handle

    def _vocabulary_once(self) -> Vocabulary:
        """llguidance's view of the tokenizer, built at the first constraint."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.config.vocab_size, set(self.tokenizer.eos_ids))
        return self._vocabulary

    def embed(self, prompt_ids: list[int], request_id: str | None = None) -> RequestHandle:
        """Queue an embedding of a prompt: it is prefilled like any other (its full pages found in and left to the
        prefix cache), and its one event carries the last position's final hidden state (the model's final norm
        applied), L2-normalised: last-token pooling, as vLLM pools a decoder-only model."""
        return self.submit(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), request_id, embed=True)

    def embedding(self, prompt_ids: list[int]) -> list[float]:
        """Engine.embed's vector, waited for."""
        for ev in self.embed(prompt_ids):
            if ev.finish_reason == "error":
                raise RuntimeError(ev.error or "the embedding failed")
            if ev.embedding is not None:
                return ev.embedding
        raise RuntimeError("the embedding was cancelled")

    def submit_chat(self, messages: list[dict], params: SamplingParams, request_id: str | None = None):
        return self.submit(self.encode_chat(messages), params, request_id)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        return iter(self.submit(prompt_ids, params))

    def chat(self, messages: list[dict], params: SamplingParams) -> Iterator[TokenEvent]:
        return iter(self.submit_chat(messages, params))

    def set_speculate(self, config: SpeculateConfig) -> None:
        """Speculative decoding from now on (its adaptive state starts afresh for each request); for benchmarks and
        tests that compare it with plain decoding on one engine, between requests."""
        self.speculator = self._speculator(config)

    def _speculator(self, config: SpeculateConfig) -> Speculator:
        if config.mode == "draft" and self.drafter is None:
            raise LocalpdError("speculative decoding by a draft model needs one (--draft MODEL)")
        return Speculator(config, self.device.type)

    def stats(self) -> EngineStats:
        p = self.pages
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_pages_used=p.used, kv_pages_total=p.n_pages, kv_pages_cached=len(p.cached), kv_dtype=self.kv_dtype,
            page_size=p.page_size, prefix_hit_tokens=p.hit_tokens, prefix_query_tokens=p.query_tokens,
            preemptions=self.scheduler.preemptions, weight_bytes=self.model.weight_bytes,
            max_running=self.scheduler.max_running)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def __del__(self):
        self._closed = True

    def _cancel(self, handle: RequestHandle) -> None:
        with self._wake:
            self._cancels.add(handle)
            self._wake.notify()

    # -- the engine thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._closed or self._inbox or self._cancels or self.scheduler.running
                               or self.scheduler.waiting):
                        self._wake.wait()
                    if self._closed:
                        break
                    inbox, self._inbox = list(self._inbox), deque()
                    cancels, self._cancels = self._cancels, set()
                for req in inbox:
                    self._requests[req.seq] = req
                    self.scheduler.add(req.seq)
                for req in [r for r in self._requests.values() if r.handle in cancels]:
                    self._finish(req, TokenEvent(None, "", "cancelled"))
                self._step()
        for req in list(self._requests.values()):
            self._finish(req, TokenEvent(None, "", "cancelled", error="the engine was closed"))

    def _finish(self, req: Request, event: TokenEvent) -> None:
        self.scheduler.remove(req.seq)
        self._requests.pop(req.seq, None)
        req.handle.stats.finish_reason = event.finish_reason
        req.handle._push(event)

    def _draft(self) -> None:
        """Each decoding sequence's draft for this step (engine.speculate), as long as its token budget allows: the
        draft model's in mode "draft", else prompt lookup's."""
        decoding = [(seq, self._requests[seq]) for seq in self.scheduler.running
                    if seq.pending == 1 and not self._requests[seq].embed]
        if self.speculator.config.mode != "draft":
            for seq, req in decoding:
                seq.draft = self.speculator.propose(req.draft, seq.tokens, len(seq.output), self._draft_room(seq, req),
                                                    req.sampler.constraint)
            return
        ks = [self.speculator.draft_length(req.draft, self._draft_room(seq, req), self.drafter.cost)
              for seq, req in decoding]
        # the drafting steps' positions: computed .. computed + k - 1 (a draft that does not fit is not run)
        ks = [k if k and self.pages.allocate(seq.table, seq.computed + k) else 0 for (seq, _), k in zip(decoding, ks)]
        drafts = self.drafter.propose([seq for seq, _ in decoding], ks, self.device)
        for (seq, req), draft in zip(decoding, drafts):
            constraint = req.sampler.constraint
            seq.draft = draft[:allowed_prefix(constraint, draft)] if draft and constraint is not None else draft

    def _draft_room(self, seq: Sequence, req: Request) -> int:
        """draft_room, and what the KV pages' format allows past the sequence's own token (verification_room)."""
        pages = verification_room(seq.computed + 1, PAGE_SIZE, kv_formats(self.kv_dtype))
        return draft_room(seq, req) if pages is None else min(draft_room(seq, req), pages)

    def _chain(self) -> None:
        """Where every running sequence decodes greedily with nothing to do between its tokens (plain greedy: no
        sampling, logprobs, constraint or min_tokens; no draft) and no request waits to start, the next step
        chains decode_chain decode steps in one replay (DecodeGraphs.run_chain), so that the host's time between
        steps comes once a chain. Each sequence's placeholders are its draft: the scheduler allots their positions
        as a draft's. A reply that ends inside a chain computed a few tokens past its end, never written. Not where
        the chain would take over CHAIN_SECONDS by the last decode step's time."""
        k, running, chain = self.decode_chain, self.scheduler.running, self.runner.chain
        if (chain is None or self.drafter is not None or self.scheduler.waiting or not running
                or not chain.fits(len(running)) or len(running) * k > self.scheduler.max_step_tokens
                or k * self._pass_seconds > CHAIN_SECONDS):
            return
        for seq in running:
            req = self._requests[seq]
            if seq.pending != 1 or seq.draft or not argmax_only(req) or len(seq.output) + k > seq.max_tokens:
                return
        # the chain's pages for every sequence, or none: a partial allocation could make the scheduler preempt
        if sum(self.pages.lacking(seq.table, seq.computed + k) for seq in running) > self.pages.available:
            return
        for seq in running:
            self.pages.allocate(seq.table, seq.computed + k)
            seq.draft, seq.chain = [0] * (k - 1), True

    def _step(self) -> None:
        """One step: the scheduler picks the work, the model runner computes it and samples, the output processor
        turns the samples into events."""
        if self.speculator.config.on and self.drafts_allowed:
            self._draft()
        self._chain()
        work = self.scheduler.step()
        if not work:
            if self.scheduler.waiting and not self.scheduler.running:  # the head cannot fit even alone
                req = self._requests[self.scheduler.waiting[0]]
                if req.seq.output:
                    self._finish(req, TokenEvent(None, self.output.flush(req), "length"))
                else:
                    self._finish(req, TokenEvent(None, "", "error", error="the prompt does not fit in the KV cache"))
            return
        try:
            out = self.runner.run(work, [self._requests[w.seq] for w in work if w.sample])
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("engine step failed")
            for w in work:
                if w.seq in self._requests:
                    self._finish(self._requests[w.seq], TokenEvent(None, "", "error", error=f"{type(e).__name__}: {e}"))
            return
        if out.stats.phase == "decode":
            self._pass_seconds = out.stats.seconds / out.stats.passes
        self.output.process(out, self._requests)


def draft_room(seq: Sequence, req: Request) -> int:
    """The most tokens a sequence may draft this step: its token budget's, and the request's own bound (the APIs'
    speculative.n_max)."""
    room = seq.max_tokens - len(seq.output) - 1
    return room if req.params.draft_tokens is None else min(room, req.params.draft_tokens)


def load(model: str, quant: str, dtype: torch.dtype, device: torch.device, progress: bool):
    """(name, registry entry or None, LoadedModel) of a registry name, a file or directory, or synthetic:SHAPE."""
    if model.startswith("synthetic:"):
        from localpd.load.synthetic import synthetic_model

        return model, None, synthetic_model(model.split(":", 1)[1], quant, dtype, device)
    resolved = resolve_model(model, pull=True, progress=progress)
    return resolved.name, resolved, load_model(resolved.path, dtype=dtype, device=device, scheme=quant)


async def embeddings(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    """Engine.embed of several prompts at once (their prefills share steps), awaited. A prompt the engine refuses
    raises LocalpdError, one that fails while running RuntimeError; either way the others are cancelled."""
    handles: list[RequestHandle] = []
    try:
        for ids in prompts:
            handles.append(engine.embed(ids))
        out = []
        for handle in handles:
            async for ev in handle:
                if ev.finish_reason == "error":
                    raise RuntimeError(ev.error or "the embedding failed")
                if ev.embedding is not None:
                    out.append(ev.embedding)
        if len(out) < len(prompts):
            raise RuntimeError("an embedding was cancelled")
        return out
    finally:
        for handle in handles:
            handle.cancel()  # a no-op once finished
