"""Ollama's API beside the OpenAI one, so apps made for Ollama (Open WebUI, Continue, the ollama Python and JS
libraries) work against `localpd serve` as they do against Ollama's port: POST /api/chat and /api/generate (NDJSON
streams by default, or one object with "stream": false), POST /api/embed and /api/embeddings (Engine.embed's
vectors), GET /api/tags (every model served), /api/ps (the loaded ones) and /api/version, POST /api/show, POST
/api/pull (a registry model downloaded and served, progress streamed) and DELETE /api/delete. Each request goes to
the model it names (localpd.api.models), which stays loaded `keep_alive` once idle.

A request maps onto the same engine as /v1/chat/completions: `options` onto the sampler (Ollama's defaults:
temperature 0.8, top_k 40, top_p 0.9; num_predict -1 runs to the context), `format` ("json" or a JSON schema) onto
JSON mode, `think` onto the template's enable_thinking, a thinking model's reasoning into `thinking`, `tools` onto
the template with calls parsed into `tool_calls` (arguments as objects). The last line carries Ollama's counts and
durations in nanoseconds, and localpd's `timings` (decode bytes/s, MBU). Errors are Ollama's {"error": "..."}.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from localpd import __version__
from localpd.api.models import ServedModel
from localpd.api.reply import Reply
from localpd.api.schemas import ToolSpec
from localpd.api.service import ApiError, ClosingStream, Service
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle
from localpd.engine.sampling import SamplingParams
from localpd.errors import LocalpdError
from localpd.load.registry import file_size

log = logging.getLogger("localpd.api.app")
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
TAKEN = {*DEFAULTS, "num_predict", "seed", "stop"}  # the options localpd reads; others (num_ctx, num_gpu...) are
# the loaded model's or Ollama's own, and are logged and left


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None  # a user's is needed
    images: list[str] | None = None
    thinking: str | None = None  # an earlier reply's reasoning
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, arguments as objects
    tool_name: str | None = None  # a tool message: the function whose result it is


class OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    stream: bool = True
    format: Literal["json", ""] | dict[str, Any] | None = None  # "": none, as some clients send it
    options: dict[str, Any] | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: Any = None  # how long the model stays loaded once idle (localpd.api.models.keep_alive_seconds)


class ChatBody(OllamaRequest):
    messages: list[OllamaMessage] = []
    tools: list[ToolSpec] | None = None


class GenerateBody(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    context: list[int] | None = None
    template: str | None = None


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    input: str | list[str] = []
    truncate: bool = True  # an input past the context keeps its start; False: a 400
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None


class PullBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # what older clients send
    stream: bool = True


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None


class LegacyEmbedBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Any = None


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def sampling(e: Engine, body: OllamaRequest) -> SamplingParams:
    """Ollama's options as the sampler's parameters; a value of the wrong type is a 400."""
    o = {**DEFAULTS, **{k: v for k, v in (body.options or {}).items() if v is not None}}
    if set(o) - TAKEN:
        log.info("ignoring Ollama options: %s", ", ".join(sorted(set(o) - TAKEN)))

    def number(key: str, kind=float):
        try:
            return kind(o[key])
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, f"option {key} must be a number, got {o[key]!r}") from None

    limit = number("num_predict", int) if "num_predict" in o else -1
    stop = o.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "option stop must be a list of strings")
    fmt = body.format
    seed = number("seed", int) if "seed" in o else -1  # negative: a random seed, as llama.cpp's -1
    return SamplingParams(
        temperature=number("temperature"), top_k=max(number("top_k", int), 0), top_p=number("top_p"),
        min_p=number("min_p"), repetition_penalty=number("repeat_penalty"),
        presence_penalty=number("presence_penalty"), frequency_penalty=number("frequency_penalty"),
        seed=seed if seed >= 0 else None, max_tokens=limit if limit > 0 else e.max_context,
        stop=stop, json_object=fmt not in (None, ""), json_schema=fmt if isinstance(fmt, dict) else None)


def thinking(body: OllamaRequest) -> dict | None:
    """`think` as the template's variable (Qwen3's enable_thinking); unset leaves the template's default."""
    return None if body.think is None else {"enable_thinking": body.think is not False}


def template_message(m: OllamaMessage) -> dict:
    if m.images:
        raise ApiError(400, "the models localpd runs take text only; a message with images cannot be read")
    if m.role == "user" and m.content is None:
        raise ApiError(400, "a user message needs content")
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": c.get("function", c)} for c in m.tool_calls]
    if m.tool_name:
        out["name"] = m.tool_name
    if m.thinking:
        out["reasoning_content"] = m.thinking
    return out


def ollama_router(service: Service) -> APIRouter:
    router = APIRouter(prefix="/api")

    @router.get("/version")
    async def version():
        return {"version": __version__}

    @router.get("/tags")
    async def tags():
        """Every model served, loaded or not."""
        return {"models": [listed(m) for m in list(service.pool.models.values())]}

    @router.get("/ps")
    async def ps():
        """The models loaded now, with the bytes they hold and when they unload if left idle."""
        out = []
        for m in service.pool.loaded():
            e = m.engine
            if e is None:  # unloaded since
                continue
            out.append({**listed(m), "size": m.size, "size_vram": m.size if e.device.type == "cuda" else 0,
                        "expires_at": expiry(m), "context_length": e.max_context})
        return {"models": out}

    @router.post("/pull")
    async def pull(body: PullBody):
        """A registry model downloaded (if it is not here yet) and served from now on, its progress streamed as
        Ollama's (status lines, then "success"; an error as {"error": ...})."""
        name = (body.model or body.name or "").removesuffix(":latest")
        progress = service.pull(name)
        first = await anext(progress)  # a name that is not in the registry is a 404 before the stream starts
        if not body.stream:
            last = first
            async for last in progress:
                pass
            if "error" in last:
                raise ApiError(500, last["error"], "server_error")
            return last

        async def ndjson():
            yield json.dumps(first) + "\n"
            async for update in progress:
                yield json.dumps(update) + "\n"

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @router.delete("/delete")
    async def delete(body: DeleteBody):
        """A downloaded registry model's files removed, and the model no longer served; one loaded is a 400."""
        service.delete((body.model or body.name or "").removesuffix(":latest"))
        return Response(status_code=200)

    @router.post("/create")
    @router.post("/copy")
    @router.post("/push")
    async def manage():
        raise ApiError(400, "localpd serves the registry's models and model files; they are added with /api/pull "
                            "or `localpd pull`, not created, copied or pushed through the API")

    @router.post("/show")
    async def show(body: dict[str, Any]):
        e = await service.engine(body.get("model") or body.get("name"), body.get("keep_alive"))
        template = e.tokenizer.chat_template if e.tokenizer else None
        caps = ["completion"] + (["tools"] if template and "tools" in template else []) + (
            ["thinking"] if template and "think" in template else [])
        return {"modelfile": "", "parameters": "", "template": template or "", "details": describe(e)["details"],
                "model_info": {"general.architecture": e.config.arch,
                               f"{e.config.arch}.context_length": e.max_context},
                "capabilities": caps}

    @router.post("/embed")
    async def embed(body: EmbedBody):
        """Each input's last-token hidden state, L2-normalised (Engine.embed)."""
        start = time.perf_counter()
        e = await service.engine(body.model, body.keep_alive)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        service.check_dimensions(e, body.dimensions)
        vectors, ids = await embed_texts(service, e, inputs, body.truncate)
        return {"model": e.name, "embeddings": vectors, "total_duration": ns(time.perf_counter() - start),
                "load_duration": 0, "prompt_eval_count": sum(map(len, ids))}

    @router.post("/embeddings")
    async def legacy_embed(body: LegacyEmbedBody):
        """The older endpoint: one prompt, {"embedding": [...]} ([] for an empty prompt, as Ollama answers)."""
        e = await service.engine(body.model, body.keep_alive)
        if not body.prompt:
            return {"embedding": []}
        vectors, _ = await embed_texts(service, e, [body.prompt], truncate=True)
        return {"embedding": vectors[0]}

    @router.post("/chat")
    async def chat(body: ChatBody):
        e = await service.engine(body.model, body.keep_alive)
        if not body.messages:  # Ollama's way to load a model: nothing to answer
            return {"model": e.name, "created_at": now(), "message": {"role": "assistant", "content": ""},
                    "done_reason": "load", "done": True}
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        last_reply = body.messages[-1].role == "assistant" and bool(body.messages[-1].content)
        ids = service.chat_prompt(e, [template_message(m) for m in body.messages], thinking(body), tools or None,
                                  continue_final=last_reply)
        return await run(service, e, body, ids, chat=True, tools=bool(tools))

    @router.post("/generate")
    async def generate(body: GenerateBody):
        e = await service.engine(body.model, body.keep_alive)
        for field, value in (("images", body.images), ("context", body.context), ("template", body.template)):
            if value:
                raise ApiError(400, f"{field} is not supported by localpd's /api/generate"
                                    + ("; send the conversation to /api/chat" if field == "context" else ""))
        if not body.prompt:
            return {"model": e.name, "created_at": now(), "response": "", "done_reason": "load", "done": True}
        if e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer")
        if body.suffix:  # fill in the middle (a code model's FIM tokens), as an editor's completion asks
            try:
                ids = e.tokenizer.fim_prompt(body.prompt, body.suffix)
            except LocalpdError as err:
                raise ApiError(400, str(err)) from None
            return await run(service, e, body, ids, chat=False, tools=False, raw=True, ends=e.tokenizer.fim_end_ids)
        if body.raw:
            ids = e.tokenizer.encode(body.prompt)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}]
            ids = service.chat_prompt(e, messages, thinking(body))
        return await run(service, e, body, ids, chat=False, tools=False, raw=body.raw)

    return router


async def embed_texts(service: Service, e: Engine, texts: list[str],
                      truncate: bool) -> tuple[list[list[float]], list[list[int]]]:
    if any(not t for t in texts):
        raise ApiError(400, "an input is empty")
    ids = service.embedding_ids(e, texts, truncate)
    return await service.embed(e, ids), ids


async def run(service: Service, e: Engine, body: OllamaRequest, ids: list[int], chat: bool, tools: bool,
              raw: bool = False, ends: set[int] = frozenset()):
    """ends: tokens that end the reply beside eos (an infill's)."""
    service.check_context(e, ids)
    service.admit(e, 1)
    params = sampling(e, body)
    if ends:
        params = replace(params, stop_token_ids=sorted(set(params.stop_token_ids) | ends))
    reply = service.replies(e, ids, not raw, "" if tools else None)()
    handle = service.submit(e, [ids], params, 1, "ollama-" + uuid.uuid4().hex[:24])[0]
    start = time.monotonic()
    if body.stream:
        return ClosingStream(lines(service, e, handle, reply, chat, start), media_type="application/x-ndjson")
    return await whole(service, e, handle, reply, chat, start)


def part(e: Engine, chat: bool, text: str, reasoning: str, calls: list[dict] | None = None) -> dict:
    out: dict[str, Any] = {"model": e.name, "created_at": now()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if reasoning:
            out["message"]["thinking"] = reasoning
        if calls:
            out["message"]["tool_calls"] = calls
    else:
        out["response"] = text
        if reasoning:
            out["thinking"] = reasoning
    return {**out, "done": False}


DONE_REASONS = {"length": "length", "cancelled": "abort"}  # cancelled: cut by the server's shutdown


def last(service: Service, e: Engine, handle: RequestHandle, chat: bool, start: float, reason: str | None) -> dict:
    s = handle.stats
    out = part(e, chat, "", "")
    out.update(done=True, done_reason=DONE_REASONS.get(reason, "stop"),
               total_duration=ns(time.monotonic() - start), load_duration=0,
               prompt_eval_count=s.prompt_tokens, prompt_eval_duration=ns(s.prefill_seconds),
               eval_count=s.output_tokens, eval_duration=ns(s.decode_seconds), timings=service.finished(e, handle))
    return out


async def lines(service: Service, e: Engine, handle: RequestHandle, reply: Reply, chat: bool, start: float):
    ended = False
    try:
        async for ev in handle:
            if ev.finish_reason == "error":
                yield json.dumps({"error": ev.error or "generation failed"}) + "\n"
                return
            reasoning, text = reply.feed(ev.text)
            calls = []
            if ev.finish_reason is not None:
                more, rest, calls = reply.finish()
                reasoning, text = reasoning + more, text + rest
            if text or reasoning:
                yield json.dumps(part(e, chat, text, reasoning)) + "\n"
            if calls:
                yield json.dumps(part(e, chat, "", "", shaped(calls))) + "\n"
            if ev.finish_reason is not None:
                ended = True
                yield json.dumps(last(service, e, handle, chat, start, ev.finish_reason)) + "\n"
    finally:
        handle.cancel()  # no-op when finished; frees the pages of a client that went away
        if not ended:
            service.finished(e, handle)


async def whole(service: Service, e: Engine, handle: RequestHandle, reply: Reply, chat: bool, start: float):
    try:
        result = await service.collect(handle)
    finally:
        handle.cancel()
    if result.finish_reason == "error":
        service.finished(e, handle)
        return JSONResponse({"error": result.error or "generation failed"}, status_code=500)
    reasoning, answer, calls = reply.whole(result.text)
    return {**last(service, e, handle, chat, start, result.finish_reason),
            **part(e, chat, answer, reasoning, shaped(calls)), "done": True}


def shaped(calls: list[dict]) -> list[dict]:
    """OpenAI-shaped calls (arguments as JSON text) as Ollama gives them: arguments as an object."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


def listed(m: ServedModel) -> dict:
    """A served model as /api/tags lists it: its size on disk and when its file changed, where known; its details
    once it is loaded."""
    e = m.engine
    out = describe(e, m.id) if e is not None else {
        "name": m.id, "model": m.id, "modified_at": "0001-01-01T00:00:00Z", "size": m.size, "digest": "",
        "details": {"format": "", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}}
    if m.path is not None and m.path.exists():
        modified = datetime.fromtimestamp(m.path.stat().st_mtime, timezone.utc)
        out.update(size=file_size(m.path), modified_at=modified.isoformat().replace("+00:00", "Z"))
    return out


def expiry(m: ServedModel) -> str:
    """When an idle model unloads, as Ollama's /api/ps gives it (a far date: kept while the server runs)."""
    left = m.expires - time.monotonic()
    if left > 10 * 365 * 86400:
        return "2318-01-01T00:00:00Z"
    at = datetime.now(timezone.utc) + timedelta(seconds=max(left, 0))
    return at.isoformat().replace("+00:00", "Z")


def describe(e: Engine, name: str | None = None) -> dict:
    """The model as /api/tags lists it: its size is the bytes a decode step reads, its parameters the matrices'
    (the output head's included, the embedding's not)."""
    n = e.model.body_params + e.model.lm_head.params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    name = name or e.name
    return {"name": name, "model": name, "modified_at": "0001-01-01T00:00:00Z", "size": e.model.weight_bytes,
            "digest": "", "details": {"format": "", "family": e.config.arch, "families": [e.config.arch],
                                      "parameter_size": size, "quantization_level": e.quant}}
