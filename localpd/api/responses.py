"""OpenAI's Responses API over the service: POST /v1/responses, for the clients that call it (openai's
`client.responses.create`, openai-agents' default model, pydantic-ai's OpenAIResponsesModel).

`input` (a string, or items: messages, function_call and function_call_output items, earlier reasoning) and
`instructions` become the chat template's conversation, function `tools` and `tool_choice` OpenAI's chat ones,
`text.format` the chat's response_format; from there it is the chat completion's path (Service). The reply is output
items: a thinking model's reasoning (its text as a summary), the message, the function calls; streamed as the API's
typed events. A response is kept in memory (the last MAX_KEPT, unless `store` is false) so that a later request's
`previous_response_id` goes on from its conversation; one not kept is a 400."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from localpd.api.reply import Reply
from localpd.api.service import ApiError, ClosingStream, Service
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle
from localpd.engine.sampling import SamplingParams

MAX_KEPT = 1024  # responses kept for previous_response_id, the oldest dropped first


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None


def item_text(content: Any, where: str) -> str:
    """The text of a message item's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text") or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}: a {kind!r} part cannot be read; the models localpd runs take text",
                           param="input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as the chat template's messages: a function_call joins the assistant message before it (or starts
    one), a function_call_output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}: role must be user, assistant, system or developer", param="input")
            if "content" not in item:
                raise ApiError(400, f"{where}: a message needs content", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": item_text(item["content"], where)})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name or not isinstance(args, str):
                raise ApiError(400, f"{where}: a function_call needs a name and arguments (JSON text)",
                               param="input")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            if not out or out[-1]["role"] != "assistant" or out[-1].get("content"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else item_text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":  # an earlier reply's reasoning: goes with the assistant message after it
            continue
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


def output_items(reasoning: str, text: str, calls: list[dict], thinking: bool) -> list[dict]:
    out = []
    if thinking and reasoning:
        out.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "status": "completed",
                    "summary": [{"type": "summary_text", "text": reasoning}]})
    if text or not calls:
        out.append({"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "completed",
                    "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                      "logprobs": []}]})
    return out + [{"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                   "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                  for c in calls]


def reply_message(reasoning: str, text: str, calls: list[dict]) -> dict:
    """The reply as the conversation's next assistant message (what previous_response_id goes on from)."""
    out = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


class Responses:
    """The handler behind /v1/responses: the request made a chat, the responses kept."""

    def __init__(self, service: Service):
        self.service = service
        self.kept: OrderedDict[str, list[dict]] = OrderedDict()  # id -> the conversation with its reply
        self.lock = threading.Lock()

    def conversation(self, body: ResponsesRequest) -> list[dict]:
        earlier = []
        if body.previous_response_id is not None:
            with self.lock:
                earlier = self.kept.get(body.previous_response_id)
            if earlier is None:
                raise ApiError(400, f"previous response {body.previous_response_id!r} is not kept by this server "
                                    f"(kept: the last {MAX_KEPT} stored since it started)",
                               param="previous_response_id", code="previous_response_not_found")
            earlier = [m for m in earlier if m["role"] != "system"]  # this request's instructions instead
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        return system + earlier + input_messages(body.input)

    def keep(self, rid: str, messages: list[dict], reply: dict) -> None:
        with self.lock:
            self.kept[rid] = messages + [reply]
            while len(self.kept) > MAX_KEPT:
                self.kept.popitem(last=False)

    async def create(self, body: ResponsesRequest):
        service = self.service
        e = await service.engine(body.model)
        messages = self.conversation(body)
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                 for t in body.tools or []]
        final = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
        ids, replies, forced = service.tool_prompt(e, messages, tools, choice, None, final,
                                                   body.parallel_tool_calls)
        service.check_context(e, ids, body.max_output_tokens, param="input")
        service.admit(e, 1)
        fmt = body.text.format if body.text and body.text.format else TextFormat()
        if fmt.type == "json_schema" and not isinstance(fmt.schema_, dict):
            raise ApiError(400, "text.format json_schema needs a schema", param="text.format")
        if fmt.type != "text" and forced:
            raise ApiError(400, "text.format cannot be combined with a forced tool call", param="text.format")
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p or 1.0,
            max_tokens=body.max_output_tokens or e.max_context, json_object=fmt.type != "text" or bool(forced),
            json_schema=forced[1] if forced else fmt.schema_, json_lead=forced[0] if forced else "")
        rid = "resp_" + uuid.uuid4().hex[:24]
        field = "tools" if forced else "text.format"
        handle = service.submit(e, [ids], params, 1, rid, lambda err: err.param or field)[0]
        shell = {"id": rid, "object": "response", "created_at": int(time.time()), "model": e.name,
                 "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
                 "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                 "temperature": body.temperature, "top_p": body.top_p, "tools": [t.model_dump() for t in body.tools or []],
                 "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls,
                 "previous_response_id": body.previous_response_id, "store": body.store,
                 "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                 "metadata": body.metadata or {}, "usage": None}
        reply = replies()
        if body.stream:
            return ClosingStream(self.events(e, body, handle, reply, shell, messages),
                                 media_type="text/event-stream")
        result = await service.collect_whole(e, handle)
        reasoning, text, calls = reply.whole(result.text)
        if body.store:
            self.keep(rid, messages, reply_message(reasoning, text, calls))
        return ended(shell, handle, result.finish_reason, output_items(reasoning, text, calls,
                                                                       reply.think is not None))

    async def events(self, e: Engine, body: ResponsesRequest, handle: RequestHandle, reply: Reply, shell: dict,
                     messages: list[dict]):
        """The typed events: response.created and .in_progress; each output item added, its text's deltas (a
        reasoning item's as summary text, the message's as output text), done; the function calls whole; then
        response.completed (or .incomplete, cut by max_output_tokens)."""
        number = 0

        def event(kind: str, **data) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **data})}\n\n"

        items: list[dict] = []  # output items so far, the last one open while its text streams
        texts: list[str] = []

        def open_item(kind: str) -> list[str]:
            """Closes the open item unless it is `kind`'s, and adds a `kind` one."""
            if items and items[-1]["type"] == kind and items[-1]["status"] == "in_progress":
                return []
            out = close_item()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "status": "in_progress",
                        "summary": []}
                part = {"type": "summary_text", "text": ""}
            else:
                item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                        "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            items.append(item)
            texts.append("")
            where = dict(item_id=item["id"], output_index=len(items) - 1)
            out.append(event("response.output_item.added", output_index=len(items) - 1, item=item))
            if kind == "reasoning":
                out.append(event("response.reasoning_summary_part.added", **where, summary_index=0, part=part))
            else:
                out.append(event("response.content_part.added", **where, content_index=0, part=part))
            return out

        def delta(text: str) -> str:
            item = items[-1]
            texts[-1] += text
            where = dict(item_id=item["id"], output_index=len(items) - 1)
            if item["type"] == "reasoning":
                return event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text)
            return event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])

        def close_item() -> list[str]:
            if not items or items[-1]["status"] != "in_progress":
                return []
            item, text = items[-1], texts[-1]
            where = dict(item_id=item["id"], output_index=len(items) - 1)
            item["status"] = "completed"
            if item["type"] == "reasoning":
                part = {"type": "summary_text", "text": text}
                item["summary"] = [part]
                out = [event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                       event("response.reasoning_summary_part.done", **where, summary_index=0, part=part)]
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item["content"] = [part]
                out = [event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                       event("response.content_part.done", **where, content_index=0, part=part)]
            return out + [event("response.output_item.done", output_index=len(items) - 1, item=item)]

        service = self.service
        try:
            yield event("response.created", response=shell)
            yield event("response.in_progress", response=shell)
            reason, calls = None, []
            async for ev in handle:
                if ev.finish_reason == "error":
                    failed = {**shell, "status": "failed",
                              "error": {"code": "server_error", "message": ev.error or "generation failed"}}
                    yield event("response.failed", response=failed)
                    return
                reasoning, text = reply.feed(ev.text)
                if ev.finish_reason is not None:
                    more, rest, calls = reply.finish()
                    reasoning, text, reason = reasoning + more, text + rest, ev.finish_reason
                for kind, piece in (("reasoning", reasoning), ("message", text)):
                    if piece:
                        for line in open_item(kind):
                            yield line
                        yield delta(piece)
            if not calls and not any(item["type"] == "message" for item in items):
                for line in open_item("message"):
                    yield line
            for line in close_item():
                yield line
            for item in [i for i in output_items("", "", calls, False) if i["type"] == "function_call"]:
                index = len(items)
                items.append(item)
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                where = dict(item_id=item["id"], output_index=index)
                yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield event("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            done = ended(shell, handle, reason, items)
            if body.store:
                reasoning = "".join(t for item, t in zip(items, texts) if item["type"] == "reasoning")
                text = "".join(t for item, t in zip(items, texts) if item["type"] == "message")
                self.keep(shell["id"], messages, reply_message(reasoning, text, calls))
            yield event("response.completed" if done["status"] == "completed" else "response.incomplete",
                        response=done)
        finally:
            handle.cancel()  # no-op when finished; frees the pages of a client that went away
            service.finished(e, handle)


def ended(shell: dict, handle: RequestHandle, reason: str | None, output: list[dict]) -> dict:
    """The whole response: its output items, status (incomplete when max_output_tokens cut it, or the server's
    shutdown) and usage."""
    s = handle.stats
    incomplete = {"length": {"reason": "max_output_tokens"}, "cancelled": {"reason": "server_shutdown"}}.get(reason)
    return {**shell, "status": "incomplete" if incomplete else "completed", "incomplete_details": incomplete,
            "output": output,
            "usage": {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                      "output_tokens": s.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": s.prompt_tokens + s.output_tokens}}


def responses_router(service: Service) -> APIRouter:
    router = APIRouter()
    handler = Responses(service)

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest):
        return await handler.create(body)

    return router
