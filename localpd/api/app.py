"""`localpd serve`: an OpenAI-compatible HTTP API over the engine, on loopback by default.

Every request becomes an engine request; streams are server-sent events ending with `data: [DONE]`. A client
that goes away mid-stream cancels its request, which frees its KV pages at the engine's next step. Errors
always have OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import struct
import time
import uuid
from dataclasses import replace
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localpd.text.chat_template import check_template_vars
from localpd.measure.device import device_info
from localpd.engine import Engine
from localpd.engine.engine import MAX_EMBED_INPUTS, embeddings
from localpd.engine.requests import RequestHandle, TokenEvent
from localpd.errors import LocalpdError
from localpd.measure.roofline import decode_ceiling_tps, utilisation
from localpd.api.ollama import OllamaError, ollama_router
from localpd.constrain.pattern import PatternError, choice_pattern, compiled
from localpd.engine.sampling import SamplingParams
from localpd.constrain.reasoning import ThinkSplit, reply_split, split_reply
from localpd.api.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, Message,
                                   NamedToolChoice,
                                   Sampling, TokenizeRequest, error_body)
from localpd.constrain.tools import CallStream, ToolCall, call_schema, check_choice, forced_prefix, parse_calls

log = logging.getLogger("localpd.api.app")

MAX_BODY = 10 * 2**20
MAX_CHOICES = 16  # a request's prompts x n: each choice is a sequence in the engine
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


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
        with self.lock:
            self.requests[s.finish_reason] = self.requests.get(s.finish_reason, 0) + 1
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


def create_app(engine: Engine | None = None, load: Callable[[], Engine] | None = None, api_key: str | None = None,
               max_waiting: int = 64, bandwidth: float | None = None, split_reasoning: bool = True,
               cors_origins: list[str] | None = None) -> FastAPI:
    """engine: a loaded engine; or load: called on a background thread at startup (/health says 503 until then).
    split_reasoning: a thinking model's <think> block goes to the message's reasoning_content, not its content.
    cors_origins: web origins whose pages may call the API from a browser ("*": any); their preflight requests
    are answered before the API key is asked for, as browsers send them without it.
    bandwidth: bytes/s the MBU in `timings` and /metrics is measured against (default: the device's measured
    copy bandwidth, else its datasheet peak; localpd.measure.device)."""
    app = FastAPI(title="localpd", version="0.1.0", description="OpenAI-compatible local inference")
    state = {"engine": engine, "error": None, "bandwidth": bandwidth}
    metrics = Metrics()

    if load is not None and engine is None:
        def loader():
            try:
                state["engine"] = load()
            except Exception as e:  # noqa: BLE001 - reported by /health and every route
                log.exception("loading the model failed")
                state["error"] = str(e)

        threading.Thread(target=loader, name="localpd-load", daemon=True).start()

    def ready() -> Engine:
        if state["engine"] is None:
            message = f"the model failed to load: {state['error']}" if state["error"] else "the model is loading"
            raise ApiError(503, message, "server_error", code="model_not_ready")
        return state["engine"]

    def error(request: Request, body: dict, status: int) -> JSONResponse:
        """OpenAI's error shape, or under /api/ Ollama's ({"error": "..."})."""
        if request.url.path.startswith("/api/"):
            body = {"error": body["error"]["message"]}
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error(request, e.body, e.status)

    @app.exception_handler(OllamaError)
    async def ollama_error(_: Request, e: OllamaError):
        return JSONResponse({"error": e.message}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
        return error(request, error_body(message, "invalid_request_error", ".".join(loc) or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(request, error_body(str(e.detail), type_), e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        rid = uuid.uuid4().hex[:12]
        log.exception("request %s %s failed (id %s)", request.method, request.url.path, rid)
        return error(request, error_body(f"internal error (request id {rid})", "server_error"), 500)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path not in ("/health", "/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(request, error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                                 "authentication_error", code="invalid_api_key"), 401)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            return error(request, error_body(f"request body larger than {MAX_BODY} bytes", "invalid_request_error",
                                             code="request_too_large"), 413)
        return await call_next(request)

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        """What Ollama's clients probe to see that a server is up (Ollama answers "Ollama is running")."""
        return "localpd is running: the OpenAI API under /v1, Ollama's under /api"

    @app.get("/health")
    async def health():
        if state["engine"] is None:
            return JSONResponse({"status": "error" if state["error"] else "loading", "error": state["error"]},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        e = ready()
        return {"object": "list", "data": [{"id": e.name, "object": "model", "created": 0, "owned_by": "localpd",
                                            "max_model_len": e.max_context}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt, or of a conversation in the model's chat template (vLLM's and llama.cpp's)."""
        e = ready()
        if e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer", param="prompt")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt")
        if body.messages is not None:
            try:
                ids = e.encode_chat(text_messages(body.messages),
                                    template_vars=body.chat_template_kwargs,
                                    add_generation_prompt=body.add_generation_prompt)
            except LocalpdError as err:
                raise ApiError(400, str(err), param="messages") from None
        else:
            ids = e.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": e.max_context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        e = ready()
        if e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer", param="tokens")
        bad = [t for t in body.tokens if not 0 <= t < e.config.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary of {e.config.vocab_size}",
                           param="tokens")
        return {"prompt": e.tokenizer.decode(body.tokens, skip_special=False)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics.render(state["engine"]), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        e = ready()
        log_unknown(body)
        messages = text_messages(body.messages)
        try:
            check_template_vars(body.chat_template_kwargs or {})
        except LocalpdError as err:
            raise ApiError(400, str(err), param="chat_template_kwargs") from None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if choice != "none" else []
        if choice == "required" and len(tools) == 1:  # one tool to call: call it by name, its parameters held
            choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        template = e.tokenizer.chat_template if e.tokenizer else None
        try:
            check_choice(choice, tools)
            prefix = forced_prefix(template, choice)
            schema = call_schema(template, choice, tools)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="tool_choice") from None
        try:
            ids = e.encode_chat(messages, template_vars=body.chat_template_kwargs, tools=tools or None,
                                continue_final=body.continue_final_message)
        except LocalpdError as err:
            raise ApiError(400, str(err), param="messages") from None
        think = reply_split(e.tokenizer, ids) if split_reasoning and not prefix else None
        if prefix:
            ids += e.tokenizer.encode(prefix, add_bos=False)
        top = body.top_logprobs if body.logprobs else None
        limit = body.max_completion_tokens or body.max_tokens

        def reply() -> Reply:
            split = None if think is None else ThinkSplit(think.inside)
            return Reply(split, prefix if tools else None, body.parallel_tool_calls)
        forced = (prefix[prefix.index("{"):], schema) if prefix else None
        return await respond(e, body, [ids], limit, None if not body.logprobs else (top or 0), chat=True, reply=reply,
                             forced=forced)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        e = ready()
        log_unknown(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or token ids
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of other than n is not supported (candidates are not ranked)", param="best_of")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs (the prompt's own log-probabilities) is not supported",
                           param="echo")
        if isinstance(prompts[0], str) and e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer: send the prompt as token ids", param="prompt")
        if body.suffix:  # fill in the middle: what goes between each prompt and the suffix ("": none)
            if body.echo or not all(isinstance(p, str) for p in prompts):
                raise ApiError(400, "suffix takes prompts as text, without echo", param="suffix")
            try:
                ids = [e.tokenizer.fim_prompt(p, body.suffix) for p in prompts]
            except LocalpdError as err:
                raise ApiError(400, f"{e.name}: {err}", param="suffix") from None
            body.stop_token_ids = sorted(set(body.stop_token_ids or []) | e.tokenizer.fim_end_ids)
            return await respond(e, body, ids, body.max_tokens or 16, body.logprobs, chat=False)
        ids = [e.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else e.tokenizer.decode(p) if e.tokenizer else "" for p in prompts]
        return await respond(e, body, ids, body.max_tokens or 16, body.logprobs, chat=False, echo=echo)

    @app.post("/v1/embeddings")
    async def embed(body: EmbeddingRequest):
        """Each input's last-token hidden state, L2-normalised (Engine.embed), as OpenAI's embeddings: floats, or
        base64 of little-endian float32 (what the openai client asks for by default)."""
        e = ready()
        log_unknown(body)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise ApiError(400, "the input is empty", param="input")
        if len(inputs) > MAX_EMBED_INPUTS:
            raise ApiError(400, f"at most {MAX_EMBED_INPUTS} inputs a request, {len(inputs)} were sent", param="input")
        if body.dimensions is not None and body.dimensions != e.config.dim:
            raise ApiError(400, f"{e.name}'s embeddings have {e.config.dim} dimensions and cannot be shortened",
                           param="dimensions")
        if isinstance(inputs[0], str) and e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer: send the input as token ids", param="input")
        ids = [e.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
        for i, x in enumerate(ids):
            if not x:
                raise ApiError(400, f"input {i} is empty", param="input")
            if len(x) >= e.max_context:
                raise ApiError(400, f"this model's context is {e.max_context} tokens; input {i} has {len(x)}",
                               param="input", code="context_length_exceeded")
        if e.stats().waiting > max_waiting:
            raise ApiError(503, "too many requests are waiting; try again shortly", "server_error", code="overloaded")
        try:
            vectors = await embeddings(e, ids)
        except LocalpdError as err:  # refused at submission: a token id outside the vocabulary, say
            raise ApiError(400, str(err), param=err.param or "input") from None
        except RuntimeError as err:
            raise ApiError(500, str(err), "server_error") from None

        def encoded(v: list[float]):
            return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if body.encoding_format == "base64" else v

        n = sum(map(len, ids))
        return {"object": "list", "model": e.name, "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]}

    async def respond(e: Engine, body: Sampling, prompts: list[list[int]], limit: int | None,
                      logprobs: int | None, chat: bool, reply: Callable[[], Reply] | None = None,
                      forced: tuple[str, dict] | None = None, echo: list[str] | None = None):
        """prompts: token ids of each prompt (several for a completion request). reply: makes each choice's Reply
        (chat). forced: (the JSON a forced tool call opened in the prompt, which the reply must go on from, the
        call's JSON schema). echo: each prompt's text, which its choices' texts start with.

        Each prompt gets n choices, indexed prompt by prompt, each its own request: the first one's prefill caches
        the prompt's pages and the others start from them (localpd.engine.scheduler); with a seed, a prompt's choice j
        samples with seed + j."""
        where = "messages" if chat else "prompt"
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} choices in all (prompts x n), {len(prompts) * body.n} were "
                                f"asked for", param="n")
        for ids in prompts:
            if not ids:
                raise ApiError(400, "the prompt is empty", param=where)
            room = e.max_context - len(ids)
            if room < 1 or (limit is not None and limit > room):
                raise ApiError(400, f"this model's context is {e.max_context} tokens; the prompt has {len(ids)} "
                                    f"and {limit or 1} more were asked for", param="max_tokens" if room >= 1 else where,
                               code="context_length_exceeded")
        if e.stats().waiting + len(prompts) * body.n > max_waiting:
            raise ApiError(503, "too many requests are waiting; try again shortly", "server_error",
                           code="overloaded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        kind = body.response_format.type if body.response_format else "text"
        schema = None
        if kind == "json_schema":
            spec = (body.response_format.model_extra or {}).get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                    "{...}}}", param="response_format")
        if forced is not None:
            schema = forced[1]
        schema_field = "tools" if forced else "response_format"
        guided_field, guided_schema, regex = guided(body)
        if guided_field and (kind != "text" or forced is not None):
            raise ApiError(400, f"{guided_field} cannot be combined with response_format or a forced tool call",
                           param=guided_field)
        if guided_schema is not None:
            kind, schema, schema_field = "json_schema", guided_schema, guided_field
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0, top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, max_tokens=limit or e.max_context, stop=stop,
            logprobs=logprobs, json_object=kind != "text" or forced is not None, json_schema=schema,
            json_lead=forced[0] if forced else "", regex=regex, logit_bias=body.logit_bias or {},
            stop_token_ids=body.stop_token_ids or [], min_tokens=body.min_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        handles: list[RequestHandle] = []
        try:
            for ids in prompts:
                for j in range(body.n):
                    seed = None if body.seed is None else body.seed + j
                    handle_id = rid if len(prompts) * body.n == 1 else f"{rid}-{len(handles)}"
                    handles.append(e.submit(ids, replace(params, seed=seed), request_id=handle_id))
        except LocalpdError as err:
            for handle in handles:
                handle.cancel()
            param = guided_field if err.param == "regex" else err.param or (None if schema is None else schema_field)
            raise ApiError(400, str(err), param=param) from None
        replies = [reply() if reply else None for _ in handles]
        echoes = [echo[i // body.n] if echo else "" for i in range(len(handles))]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(e, handles, body.n, rid, created, chat, include_usage, replies, echoes),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(collect(h, logprobs is not None) for h in handles))
        finally:
            for handle in handles:
                handle.cancel()
        choices = []
        for i, (handle, r, (text, lps, reason)) in enumerate(zip(handles, replies, results)):
            finished(e, handle)
            choice = {"index": i, "finish_reason": reason}
            if chat:
                reasoning, content, found = r.whole(text)
                empty = not content and (found or reasoning)  # a reply that is all calls or all reasoning
                choice["message"] = {"role": "assistant", "content": None if empty else content}
                if r.think is not None:
                    choice["message"]["reasoning_content"] = reasoning or None
                if found:
                    choice["message"]["tool_calls"] = found
                    choice["finish_reason"] = "tool_calls"
                choice["logprobs"] = chat_logprobs(e, lps) if logprobs is not None else None
            else:
                choice["text"] = echoes[i] + text
                choice["logprobs"] = completion_logprobs(e, lps) if logprobs is not None else None
            if len(handles) > 1:
                choice["timings"] = timings(e, handle)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": e.name, "choices": choices, "usage": usage(handles, body.n),
                "timings": timings(e, handles[0])}

    async def collect(handle: RequestHandle, keep_logprobs: bool) -> tuple[str, list[TokenEvent], str | None]:
        """A whole reply: its text, the events that carry its log-probabilities, its finish reason."""
        text, lps, reason = [], [], None
        async for ev in handle:
            text.append(ev.text)
            if keep_logprobs and ev.token_id is not None:
                lps.append(ev)
            reason = ev.finish_reason
        return "".join(text), lps, reason

    async def stream(e: Engine, handles: list[RequestHandle], n: int, rid: str, created: int, chat: bool,
                     include_usage: bool, replies: list[Reply | None], echoes: list[str]):
        """Server-sent events of the choices' replies as their tokens come, each chunk naming its choice's index;
        a completion choice's echoed prompt comes first."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict | None, **extra) -> str:
            data = {"id": rid, "object": kind, "created": created, "model": e.name,
                    "choices": [choice] if choice else [], **extra}
            return f"data: {json.dumps(data)}\n\n"

        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            async for ev in handle:
                await events.put((i, ev))

        pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        reasons: list[str | None] = [None] * len(handles)
        try:
            for i, echoed in enumerate(echoes):
                if chat:
                    yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                elif echoed:
                    yield chunk({"index": i, "text": echoed, "finish_reason": None})
            while any(r is None for r in reasons):
                i, ev = await events.get()
                reasons[i] = ev.finish_reason
                if ev.finish_reason == "error":
                    yield f"data: {json.dumps(error_body(ev.error or 'generation failed', 'server_error'))}\n\n"
                    break
                for c in choice_chunks(e, i, ev, replies[i], chat):
                    yield chunk(c)
            if include_usage:
                each = {"choice_timings": [timings(e, h) for h in handles]} if len(handles) > 1 else {}
                yield chunk(None, usage=usage(handles, n), timings=timings(e, handles[0]), **each)
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for handle in handles:
                handle.cancel()  # no-op when finished; frees the pages of a client that went away
                finished(e, handle)

    def choice_chunks(e: Engine, i: int, ev: TokenEvent, reply: Reply | None, chat: bool) -> list[dict]:
        """The chunks' choices one event of choice i makes: its text (reasoning and answer apart), and at the end
        any tool calls."""
        reason = ev.finish_reason
        reasoning, text, found = ("", ev.text, []) if reply is None else (*reply.feed(ev.text), [])
        if reason is not None and reply is not None:
            more_reasoning, rest, found = reply.finish()
            reasoning, text = reasoning + more_reasoning, text + rest
        choice = {"index": i, "finish_reason": None if found else reason}
        if chat:
            choice["delta"] = {"content": text} if text or (reason is None and not reasoning) else {}
            if reasoning:
                choice["delta"]["reasoning_content"] = reasoning
            if ev.logprob is not None and ev.token_id is not None:
                choice["logprobs"] = chat_logprobs(e, [ev])
        else:
            choice["text"] = text
        out = [choice] if text or reasoning or choice["finish_reason"] is not None or "logprobs" in choice else []
        if found:
            out += [{"index": i, "delta": {"tool_calls": [{"index": k, **c} for k, c in enumerate(found)]},
                     "finish_reason": None},
                    {"index": i, "delta": {}, "finish_reason": "tool_calls"}]
        return out

    def finished(e: Engine, handle: RequestHandle) -> dict:
        """Records a request's metrics (once, as it ends); its timings."""
        t = timings(e, handle)
        metrics.record(handle, t.get("decode_mbu"))
        return t

    def usage(handles: list[RequestHandle], n: int = 1) -> dict:
        """Each prompt counted once, as OpenAI counts it for its n choices, and the choices' tokens together;
        cached: the prompt tokens each prompt's first choice found in the prefix cache."""
        firsts = [h.stats for h in handles[::n]]
        prompt, out = sum(s.prompt_tokens for s in firsts), sum(h.stats.output_tokens for h in handles)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}

    def timings(e: Engine, handle: RequestHandle) -> dict:
        s = handle.stats
        out = {"ttft_ms": round(s.ttft * 1000, 3), "prefill_tokens_per_s": round(s.prefill_tps, 2),
               "decode_tokens_per_s": round(s.decode_tps, 2),
               "decode_bytes_per_s": round(s.decode_bytes / s.decode_step_seconds) if s.decode_step_seconds else 0}
        if state["bandwidth"] is None:
            state["bandwidth"] = device_info(e.device).bandwidth or 0.0
        bandwidth = state["bandwidth"]
        if bandwidth:
            mbu = utilisation(s.decode_bytes, s.decode_step_seconds, bandwidth)
            out["decode_mbu"] = None if mbu is None else round(mbu, 4)
            context = s.prompt_tokens + s.output_tokens
            out["ceiling_tokens_per_s"] = round(decode_ceiling_tps(e.model, context, e.kv_traffic, bandwidth), 2)
        return out

    def token_text(e: Engine, token: int) -> str:
        return e.tokenizer.decode([token], skip_special=False) if e.tokenizer is not None else str(token)

    def chat_logprobs(e: Engine, events: list[TokenEvent]) -> dict:
        def entry(token: int, lp: float) -> dict:
            text = token_text(e, token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(ev.token_id, ev.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in (ev.top_logprobs or [])]} for ev in events]}

    def completion_logprobs(e: Engine, events: list[TokenEvent]) -> dict:
        return {"tokens": [token_text(e, ev.token_id) for ev in events],
                "token_logprobs": [ev.logprob for ev in events],
                "top_logprobs": [{token_text(e, t): lp for t, lp in (ev.top_logprobs or [])} for ev in events]}

    app.include_router(ollama_router(ready, finished, Reply, split_reasoning, max_waiting))
    if cors_origins:  # added last, so it runs first: a browser's preflight carries no Authorization header
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


class Reply:
    """A chat reply's parts as it streams: the reasoning of a thinking model (localpd.constrain.reasoning), then the
    answer's text and its tool calls (localpd.constrain.tools).

    think: the reasoning's splitter (None: no split); call_prefix: None (no tools), or the start of a call that
    tool_choice put in the prompt ("" for auto)."""

    def __init__(self, think: ThinkSplit | None, call_prefix: str | None, parallel_calls: bool = True):
        self.think = think
        self.calls = None if call_prefix is None else CallStream(call_prefix)
        self.call_prefix, self.parallel_calls = call_prefix, parallel_calls

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer text) that can be sent now."""
        reasoning, answer = ("", delta) if self.think is None else self.think.feed(delta)
        return reasoning, answer if self.calls is None else self.calls.feed(answer)

    def finish(self) -> tuple[str, str, list[dict]]:
        """The rest of the reasoning and the answer, and the calls."""
        reasoning, answer = ("", "") if self.think is None else self.think.finish()
        if self.calls is None:
            return reasoning, answer, []
        answer = self.calls.feed(answer)
        rest, found = self.calls.finish()
        return reasoning, answer + rest, self._shaped(found)

    def whole(self, text: str) -> tuple[str, str, list[dict]]:
        """(reasoning, answer text, calls) of a reply that was not streamed."""
        reasoning, answer = ("", text) if self.think is None else split_reply(text, self.think.inside)
        if self.calls is None:
            return reasoning, answer, []
        answer, found = parse_calls(self.call_prefix + answer)
        return reasoning, answer, self._shaped(found)

    def _shaped(self, found: list[ToolCall]) -> list[dict]:
        found = found if self.parallel_calls else found[:1]
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in found]


def text_messages(messages: list[Message]) -> list[dict]:
    """The messages as the chat template takes them; a part that is not text is a 400, not dropped in silence
    (the model would answer without the image it was asked about)."""
    parts = [p.type for m in messages if isinstance(m.content, list) for p in m.content if p.type != "text"]
    if parts:
        raise ApiError(400, f"the models localpd runs take text only; a {parts[0]!r} content part cannot be read",
                       param="messages")
    return [m.template_dict() for m in messages]


def guided(body: Sampling) -> tuple[str | None, dict | None, str | None]:
    """vLLM's structured outputs as (the field that gave them, a JSON schema, a pattern the whole reply matches);
    at most one of them."""
    so = body.structured_outputs
    given = [(name, value) for name, value in (
        ("structured_outputs.json", so and so.json_), ("structured_outputs.regex", so and so.regex),
        ("structured_outputs.choice", so and so.choice), ("guided_json", body.guided_json),
        ("guided_regex", body.guided_regex), ("guided_choice", body.guided_choice)) if value is not None]
    if not given:
        return None, None, None
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(n for n, _ in given)}", param=given[1][0])
    name, value = given[0]
    if name.endswith("json"):
        return name, value, None
    try:
        regex = choice_pattern(value) if name.endswith("choice") else value
        compiled(regex, whole=True)  # the constraint's own, built once
    except PatternError as err:
        raise ApiError(400, f"{name}: {err}", param=name) from None
    return name, None, regex


def log_unknown(body: Sampling) -> None:
    if body.model_extra:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))


def serve(args) -> int:
    import uvicorn

    from localpd.cli.engine_args import engine_from_args

    def load() -> Engine:
        engine = engine_from_args(args, max_step_tokens=args.step_tokens, max_running=args.max_running)
        for note in engine.notes:
            log.info(note)
        return engine

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    app = create_app(load=load, api_key=args.api_key, max_waiting=args.max_waiting,
                     split_reasoning=args.reasoning == "split", cors_origins=args.cors)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
