"""Anthropic's Messages API over the service, for the clients and agent tools made for Claude: POST /v1/messages
(system, text, tool_use and tool_result blocks, thinking blocks of a thinking model, tools and tool_choice,
stop_sequences, streaming with Anthropic's event types, usage) and POST /v1/messages/count_tokens. Errors have
Anthropic's shape ({"type": "error", "error": {"type", "message"}}, localpd.api.app).

The conversation becomes the chat template's messages (a tool_result block a tool message, a tool_use block an
assistant's call), the tools OpenAI-shaped ones, and from there it is the chat completion's path (Service)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from localpd.api.reply import Reply
from localpd.api.service import ApiError, ClosingStream, Service
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle
from localpd.engine.sampling import SamplingParams


class Block(BaseModel):
    """A content block: text, tool_use (an assistant's call), tool_result (its answer), thinking; others
    (image, document) are refused."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # an earlier reply's reasoning


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[Block] = Field(min_length=1)


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] = {"type": "object"}


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def block_text(content: str | list[Block] | None, where: str) -> str:
    """The text of a string or of text blocks; another kind of block is a 400."""
    if content is None or isinstance(content, str):
        return content or ""
    for b in content:
        if b.type != "text":
            raise ApiError(400, f"{where}: a {b.type!r} block cannot be read here; the models localpd runs take text",
                           param="messages")
    return "".join(b.text or "" for b in content)


def template_messages(body: CountRequest) -> list[dict]:
    """The conversation as the chat template takes it."""
    out = [{"role": "system", "content": block_text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, reasoning, results = [], [], "", False
        for b in m.content:
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise ApiError(400, f"messages.{i}: a tool_result block needs tool_use_id", param="messages")
                results = True
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": block_text(b.content, f"messages.{i}.tool_result")})
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise ApiError(400, f"messages.{i}: a tool_use block needs a name", param="messages")
                calls.append({"id": b.id or "toolu_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning += b.thinking or ""
            else:
                raise ApiError(400, f"messages.{i}: a {b.type!r} block cannot be read in a {m.role} message; the "
                                    f"models localpd runs take text", param="messages")
        if text or calls or reasoning or not results:  # not a message of tool results alone
            message = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = reasoning
            out.append(message)
    return out


def prompt(service: Service, e: Engine, body: CountRequest) -> tuple[list[int], Any, tuple[str, dict] | None]:
    """The request's token ids, its replies' maker and a forced call (Service.tool_prompt)."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []]
    c = body.tool_choice
    choice = "auto" if c is None else {"auto": "auto", "any": "required", "none": "none"}.get(c.type)
    if c is not None and c.type == "tool":
        if not c.name:
            raise ApiError(400, "tool_choice of type tool needs a name", param="tool_choice")
        choice = {"type": "function", "function": {"name": c.name}}
    think = None if body.thinking is None else {"enable_thinking": body.thinking.type != "disabled"}
    messages = template_messages(body)
    final = messages[-1]["role"] == "assistant"  # the reply's start, which the model goes on with
    return service.tool_prompt(e, messages, tools, choice, think, final,
                               not (c and c.disable_parallel_tool_use))


def stop_reason(reason: str | None, calls: list, stop: str | None) -> str:
    """Anthropic's stop_reason; a reply cut by the server's shutdown has none of its own and ends its turn."""
    if calls:
        return "tool_use"
    if stop is not None:
        return "stop_sequence"
    return "max_tokens" if reason == "length" else "end_turn"


def matched_stop(e: Engine, body: MessagesRequest, reason: str | None, ids: list[int], text: str,
                 last: int | None) -> str | None:
    """The stop sequence a reply ended on: it ended "stop" on a token (an end-of-sequence ends on none), and the
    whole reply's text goes on past the text given with one of them."""
    if reason != "stop" or last is None or not body.stop_sequences:
        return None
    rest = e.tokenizer.decode(ids)[len(text):] if e.tokenizer else ""
    return next((s for s in body.stop_sequences if s and rest.startswith(s)), body.stop_sequences[0])


def usage(handle: RequestHandle) -> dict:
    """Anthropic's counts: input_tokens are those computed, cache_read_input_tokens those the prefix cache
    served (the prompt is their sum)."""
    s = handle.stats
    return {"input_tokens": s.prompt_tokens - s.cached_tokens, "cache_read_input_tokens": s.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": s.output_tokens}


def content_blocks(reasoning: str, text: str, calls: list[dict], thinking: bool) -> list[dict]:
    out = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if thinking and reasoning else []
    if text or not calls:
        out.append({"type": "text", "text": text})
    return out + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                   "input": arguments(c["function"]["arguments"])} for c in calls]


def arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def anthropic_router(service: Service) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest):
        e = await service.engine(body.model)
        ids, _, _ = prompt(service, e, body)
        return {"input_tokens": len(ids)}

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest):
        e = await service.engine(body.model)
        ids, replies, forced = prompt(service, e, body)
        service.check_context(e, ids, body.max_tokens)
        service.admit(e, 1)
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p or 1.0,
            top_k=body.top_k or 0, max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
            json_object=forced is not None, json_schema=forced[1] if forced else None,
            json_lead=forced[0] if forced else "")
        rid = "msg_" + uuid.uuid4().hex[:24]
        handle = service.submit(e, [ids], params, 1, rid, lambda err: "tools" if forced else err.param)[0]
        reply = replies()
        if body.stream:
            return ClosingStream(events(service, e, body, handle, reply, rid), media_type="text/event-stream")
        result = await service.collect_whole(e, handle, keep_logprobs=True)
        reasoning, text, calls = reply.whole(result.text)
        stop = matched_stop(e, body, result.finish_reason, [ev.token_id for ev in result.events], result.text,
                            result.events[-1].token_id if result.events else None)
        return {"id": rid, "type": "message", "role": "assistant", "model": e.name,
                "content": content_blocks(reasoning, text, calls, reply.think is not None),
                "stop_reason": stop_reason(result.finish_reason, calls, stop), "stop_sequence": stop,
                "usage": usage(handle)}

    return router


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def events(service: Service, e: Engine, body: MessagesRequest, handle: RequestHandle, reply: Reply, rid: str):
    """The reply as Anthropic streams it: message_start, each content block's start, deltas and stop (thinking,
    then text, then each tool_use whole, its input as one input_json_delta), message_delta with the stop reason
    and usage, message_stop."""
    message = {"id": rid, "type": "message", "role": "assistant", "model": e.name, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {**usage(handle), "output_tokens": 0}}
    index, open_kind = -1, None
    text_so_far, ids = [], []

    def block(kind: str) -> list[str]:
        """Stops the open block and starts a `kind` one unless that is open."""
        nonlocal index, open_kind
        if open_kind == kind:
            return []
        out = [sse("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                  "text": ""}
        return out + [sse("content_block_start", {"index": index, "content_block": start})]

    try:
        yield sse("message_start", {"message": message})
        reason, calls, last = None, [], None
        async for ev in handle:
            if ev.finish_reason == "error":
                yield sse("error", {"error": {"type": "api_error", "message": ev.error or "generation failed"}})
                return
            if ev.token_id is not None:
                ids.append(ev.token_id)
            text_so_far.append(ev.text)
            reasoning, text = reply.feed(ev.text)
            if ev.finish_reason is not None:
                more, rest, calls = reply.finish()
                reasoning, text, reason, last = reasoning + more, text + rest, ev.finish_reason, ev.token_id
            if reasoning:
                for line in block("thinking"):
                    yield line
                yield sse("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                            "thinking": reasoning}})
            if text:
                for line in block("text"):
                    yield line
                yield sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})
        if open_kind is None and not calls:
            for line in block("text"):
                yield line
        if open_kind == "thinking":
            yield sse("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})
        if open_kind:
            yield sse("content_block_stop", {"index": index})
        for call in calls:
            index += 1
            fn = call["function"]
            yield sse("content_block_start", {"index": index, "content_block": {
                "type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}})
            yield sse("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(arguments(fn["arguments"]))}})
            yield sse("content_block_stop", {"index": index})
        stop = matched_stop(e, body, reason, ids, "".join(text_so_far), last)
        yield sse("message_delta", {"delta": {"stop_reason": stop_reason(reason, calls, stop), "stop_sequence": stop},
                                    "usage": usage(handle)})
        yield sse("message_stop", {})
    finally:
        handle.cancel()  # no-op when finished; frees the pages of a client that went away
        service.finished(e, handle)
