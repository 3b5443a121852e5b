"""What the OpenAI and the Ollama APIs both do, once: the loaded engine (or why there is none), admission (the
queue and the context), chat prompts, a reply's reasoning and tool calls, submitting and collecting, embeddings,
and a finished request's metrics and timings. The routers parse a body, call this, and shape the answer."""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from localpd.api.metrics import Metrics
from localpd.api.models import LoadFailed, ModelPool, NoRoom, ServedModel, UnknownModel, keep_alive_seconds
from localpd.api.reply import Reply
from localpd.api.schemas import error_body
from localpd.constrain.reasoning import ThinkSplit, reply_split
from localpd.constrain.tools import call_schema, check_choice, forced_prefix
from localpd.engine import Engine
from localpd.engine.engine import embeddings
from localpd.engine.requests import RequestHandle, TokenEvent
from localpd.engine.sampling import SamplingParams
from localpd.errors import LocalpdError
from localpd.load.registry import delete_model, downloaded_bytes, file_size, load_registry, resolve_model
from localpd.measure.device import device_info
from localpd.measure.roofline import decode_ceiling_tps, utilisation

log = logging.getLogger("localpd.api.app")

PULL_UPDATE = 0.5  # seconds between a pull's progress updates
MAX_EMBED_INPUTS = 2048  # inputs of one embeddings request, as OpenAI allows


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape; under /api/ the app gives it Ollama's ({"error": ...})."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class ClosingStream(StreamingResponse):
    """A streamed reply whose generator is closed however the response ends, so that its finally cancels the
    requests of a client that went away. Starlette answers a disconnect by cancelling the stream where it waits:
    where that is a write, the generator is left at its yield, unclosed, and only the garbage collector would run
    its finally, any time later (or never), while the engine went on with requests nobody reads."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class Collected:
    """A whole reply: its text, the events that carry its log-probabilities, how it ended."""

    text: str
    events: list[TokenEvent]
    finish_reason: str | None
    error: str | None


class Service:
    def __init__(self, pool: ModelPool, max_waiting: int = 64, bandwidth: float | None = None,
                 split_reasoning: bool = True):
        """pool: the models served (localpd.api.models); its first starts loading now (/health says 503 until it
        has). max_waiting: requests queued before a 503. bandwidth: bytes/s that timings' MBU is measured against
        (default: the device's measured copy bandwidth, else its datasheet peak). split_reasoning: a thinking
        model's <think> block apart from the answer."""
        self.pool = pool
        self.max_waiting, self.bandwidth, self.split_reasoning = max_waiting, bandwidth, split_reasoning
        self.metrics = Metrics()
        self.running: weakref.WeakSet[RequestHandle] = weakref.WeakSet()  # requests submitted, not yet released
        self.closing, self.cut = False, 0  # shutting down: nothing more admitted; requests cut by it
        pool.load_now()

    def health(self) -> str | None:
        """None once a model has loaded; before, why not ("loading", or the first model's error)."""
        if self.pool.loads or self.pool.loaded():
            return None
        return self.pool.first.error or "loading"

    def served(self, model: str | None) -> ServedModel:
        """The served model a request names (localpd.api.models.ServedModel), loaded or not; not served: a 404."""
        try:
            return self.pool.find(model)
        except UnknownModel as err:
            raise ApiError(404, str(err), "not_found_error", param="model", code="model_not_found") from None

    async def engine(self, model: str | None, keep_alive=None) -> Engine:
        """The engine of the model a request names (none: the first served), loaded if need be; held until the
        response ends, then kept loaded for keep_alive (Ollama's: a duration, seconds, 0 or negative; None: the
        server's default). Not served: a 404; one that fails to load: a 500; no room for it: a 503."""
        try:
            seconds = keep_alive_seconds(keep_alive)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="keep_alive") from None
        self.served(model)
        try:
            return await self.pool.acquire(model, seconds)
        except NoRoom as err:
            raise ApiError(503, str(err), "server_error", code="model_not_ready") from None
        except LoadFailed as err:
            raise ApiError(500, str(err), "server_error", code="model_load_failed") from None

    # -- the models' files ---------------------------------------------------------------------------------------
    async def pull(self, name: str) -> AsyncIterator[dict]:
        """Downloads a registry model (localpd.load.registry) and serves it from then on: progress updates in
        Ollama's shape, as the bytes arrive, then {"status": "success"} (or {"error": ...}). A name that is not in
        the registry is a 404 at the first update; a model served and here already is a success at once."""
        served = self.pool.models.get(name)
        if served is not None and (served.engine is not None or served.path is not None and served.path.exists()):
            yield {"status": "success"}
            return
        entry = load_registry()[1].get(name)
        if entry is None:
            raise ApiError(404, f"model {name!r} not found in localpd's registry (localpd models lists it)",
                           "not_found_error", param="model", code="model_not_found")
        if self.pool.new_model is None:
            raise ApiError(400, "this server serves the models it was started with and adds none")
        yield {"status": "pulling manifest"}
        pulling = asyncio.ensure_future(asyncio.to_thread(resolve_model, name, True, False))
        status, digest = f"pulling {name}", f"sha256:{entry.sha256_for(entry.sources[0]) or ''}"
        while not pulling.done():
            await asyncio.wait({pulling}, timeout=PULL_UPDATE)
            if not pulling.done():
                yield {"status": status, "digest": digest, "completed": downloaded_bytes(name)}
        try:
            size = file_size(pulling.result().path)
        except (LocalpdError, OSError) as err:
            yield {"error": f"pulling {name} failed: {err}"}
            return
        yield {"status": status, "digest": digest, "total": size, "completed": size}
        yield {"status": "verifying sha256 digest"}  # resolve_model checked it where the registry lists one
        if name not in self.pool.models:
            self.pool.add(self.pool.new_model(name))
        yield {"status": "success"}

    def delete(self, name: str) -> None:
        """Removes a served registry model's downloaded files and stops serving it. One loaded is a 400, as is a
        model file given to the server (not localpd's download); one not served a 404."""
        if name not in self.pool.models:
            raise ApiError(404, f"model {name!r} not found", "not_found_error", param="model", code="model_not_found")
        try:
            self.pool.check_unloaded(self.pool.models[name])
            if name not in load_registry()[1]:
                raise LocalpdError(f"{name} is a model file given to the server; localpd deletes only the registry "
                                   f"models it downloaded")
            self.pool.remove(name)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="model") from None
        delete_model(name)

    # -- admission ---------------------------------------------------------------------------------------------
    def admit(self, e: Engine, requests: int) -> None:
        """A 503 when the server is shutting down, or when `requests` more would queue more than max_waiting."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if e.stats().waiting + requests > self.max_waiting:
            raise ApiError(503, "server busy: too many requests are waiting; try again shortly", "server_error",
                           code="overloaded")

    @staticmethod
    def check_context(e: Engine, ids: list[int], limit: int | None = None, what: str = "the prompt",
                      param: str = "messages") -> None:
        """A 400 when ids and `limit` reply tokens (at least one) do not fit in the context."""
        room = e.max_context - len(ids)
        if room < 1 or (limit is not None and limit > room):
            more = f" and {limit or 1} more were asked for" if limit is not None else ""
            raise ApiError(400, f"this model's context is {e.max_context} tokens; {what} has {len(ids)}{more}",
                           param="max_tokens" if room >= 1 else param, code="context_length_exceeded")

    # -- prompts and replies -----------------------------------------------------------------------------------
    @staticmethod
    def chat_prompt(e: Engine, messages: list[dict], template_vars: dict | None = None,
                    tools: list[dict] | None = None, continue_final: bool = False,
                    add_generation_prompt: bool = True) -> list[int]:
        """A conversation's token ids in the model's chat template; what it cannot take is a 400."""
        try:
            return e.encode_chat(messages, template_vars=template_vars, tools=tools, continue_final=continue_final,
                                 add_generation_prompt=add_generation_prompt)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="messages") from None

    def tool_prompt(self, e: Engine, messages: list[dict], tools: list[dict], choice, template_vars: dict | None = None,
                    continue_final: bool = False, parallel_calls: bool = True
                    ) -> tuple[list[int], Callable[[], Reply], tuple[str, dict] | None]:
        """A conversation's prompt with its tools (OpenAI's shape) and tool_choice ("none", "auto", "required" or
        {"type": "function", "function": {"name": ...}}): its token ids, what makes each choice's Reply, and for a
        forced call (required, or a named function) the JSON it opened in the prompt and the call's schema, which
        the reply is decoded against (SamplingParams.json_lead, json_schema). A choice that cannot be is a 400."""
        tools = tools if choice != "none" else []
        if choice == "required" and len(tools) == 1:  # one tool to call: call it by name, its parameters held
            choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        template = e.tokenizer.chat_template if e.tokenizer else None
        try:
            check_choice(choice, tools)
            prefix = forced_prefix(template, choice)
            schema = call_schema(template, choice, tools)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="tool_choice") from None
        ids = self.chat_prompt(e, messages, template_vars, tools or None, continue_final)
        reply = self.replies(e, ids, not prefix, prefix if tools else None, parallel_calls)
        if prefix:
            ids += e.tokenizer.encode(prefix, add_bos=False)
        return ids, reply, (prefix[prefix.index("{"):], schema) if prefix else None

    def replies(self, e: Engine, ids: list[int], split: bool = True, call_prefix: str | None = None,
                parallel_calls: bool = True) -> Callable[[], Reply]:
        """Makes a Reply for each choice of a prompt: its reasoning apart (when the server splits it, split is
        true and the prompt leaves the model thinking or about to), its tool calls parsed (call_prefix: see
        Reply)."""
        think = reply_split(e.tokenizer, ids) if self.split_reasoning and split else None
        return lambda: Reply(None if think is None else ThinkSplit(think.inside), call_prefix, parallel_calls)

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, e: Engine, prompts: list[list[int]], params: SamplingParams, n: int, request_id: str,
               param: Callable[[LocalpdError], str | None] = lambda err: err.param) -> list[RequestHandle]:
        """n requests of each prompt, choice j seeded with seed + j (modulo 2^64: OpenAI takes any integer, the
        sampler's generator 64 bits); one the engine refuses cancels those before it and is a 400 (param: the field
        to blame)."""
        handles: list[RequestHandle] = []
        try:
            for ids in prompts:
                for j in range(n):
                    seed = None if params.seed is None else (params.seed + j) % 2**64
                    handle_id = request_id if len(prompts) * n == 1 else f"{request_id}-{len(handles)}"
                    handles.append(e.submit(ids, replace(params, seed=seed), request_id=handle_id))
        except LocalpdError as err:
            for handle in handles:
                handle.cancel()
            raise ApiError(400, str(err), param=param(err)) from None
        self.running.update(handles)
        return handles

    def cut_running(self) -> int:
        """Cancels every request not yet finished, as a shutdown's grace runs out: each one's reply ends with
        finish_reason "abort" (done_reason under /api/). How many were cut."""
        cut = [h for h in list(self.running) if not h.finished]
        for handle in cut:
            handle.cancel()
        self.cut += len(cut)
        return len(cut)

    @staticmethod
    async def collect(handle: RequestHandle, keep_logprobs: bool = False) -> Collected:
        text, events, reason, error = [], [], None, None
        async for ev in handle:
            text.append(ev.text)
            if keep_logprobs and ev.token_id is not None:
                events.append(ev)
            reason, error = ev.finish_reason, ev.error
        return Collected("".join(text), events, reason, error)

    async def collect_whole(self, e: Engine, handle: RequestHandle, keep_logprobs: bool = False) -> Collected:
        """A reply that is not streamed, collected to its end: its pages freed (also when the client went away),
        its metrics recorded; one that failed is a 500."""
        try:
            result = await self.collect(handle, keep_logprobs)
        finally:
            handle.cancel()
        self.finished(e, handle)
        if result.finish_reason == "error":
            raise ApiError(500, result.error or "generation failed", "server_error")
        return result

    # -- embeddings --------------------------------------------------------------------------------------------
    @staticmethod
    def embedding_ids(e: Engine, inputs: list[str | list[int]], truncate: bool | None = None) -> list[list[int]]:
        """Each input's token ids. One past the context is a 400, or with truncate its start is embedded."""
        if len(inputs) > MAX_EMBED_INPUTS:
            raise ApiError(400, f"at most {MAX_EMBED_INPUTS} inputs a request, {len(inputs)} were sent", param="input")
        if any(isinstance(x, str) for x in inputs) and e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer: send the input as token ids", param="input")
        ids = [e.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
        for i, x in enumerate(ids):
            if not x:
                raise ApiError(400, f"input {i} is empty", param="input")
            if len(x) >= e.max_context and not truncate:
                hint = "; send truncate true to embed its start" if truncate is False else ""
                raise ApiError(400, f"this model's context is {e.max_context} tokens; input {i} has {len(x)}{hint}",
                               param="input", code="context_length_exceeded")
        return [x[:e.max_context - 1] for x in ids]

    @staticmethod
    def check_dimensions(e: Engine, dimensions: int | None) -> None:
        if dimensions is not None and dimensions != e.config.dim:
            raise ApiError(400, f"{e.name}'s embeddings have {e.config.dim} dimensions and cannot be shortened",
                           param="dimensions")

    async def embed(self, e: Engine, ids: list[list[int]]) -> list[list[float]]:
        """The prompts' vectors (localpd.engine.engine.embeddings): one the engine refuses is a 400, one that fails
        a 500."""
        self.admit(e, 0)
        try:
            return await embeddings(e, ids)
        except LocalpdError as err:  # refused at submission: a token id outside the vocabulary, say
            raise ApiError(400, str(err), param=err.param or "input") from None
        except RuntimeError as err:
            raise ApiError(500, str(err), "server_error") from None

    # -- a finished request ------------------------------------------------------------------------------------
    def finished(self, e: Engine, handle: RequestHandle) -> dict:
        """Records a request's metrics (once, as it ends); its timings."""
        t = self.timings(e, handle)
        self.metrics.record(handle, t.get("decode_mbu"), e.name)
        return t

    def timings(self, e: Engine, handle: RequestHandle) -> dict:
        s = handle.stats
        out = {"ttft_ms": round(s.ttft * 1000, 3), "prefill_tokens_per_s": round(s.prefill_tps, 2),
               "decode_tokens_per_s": round(s.decode_tps, 2),
               "decode_bytes_per_s": round(s.decode_bytes / s.decode_step_seconds) if s.decode_step_seconds else 0,
               "decode_tokens_per_pass": round(s.tokens_per_pass, 3)}
        if s.drafted_tokens:  # speculative decoding
            out["draft_tokens"], out["draft_acceptance"] = s.drafted_tokens, round(s.acceptance, 4)
        if self.bandwidth is None:
            self.bandwidth = device_info(e.device).bandwidth or 0.0
        if self.bandwidth:
            mbu = utilisation(s.decode_bytes, s.decode_step_seconds, self.bandwidth)
            out["decode_mbu"] = None if mbu is None else round(mbu, 4)
            context = s.prompt_tokens + s.output_tokens
            out["ceiling_tokens_per_s"] = round(decode_ceiling_tps(e.model, context, e.kv_traffic, self.bandwidth), 2)
        return out
