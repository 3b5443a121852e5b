"""OpenAI's API over the service: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings, and vLLM's
/tokenize and /detokenize. Streams are server-sent events ending with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
import uuid

from fastapi import APIRouter

from localpd.api.models import ServedModel
from localpd.api.reply import Reply
from localpd.api.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, Message,
                                 NamedToolChoice, Sampling, TokenizeRequest, error_body)
from localpd.api.service import ApiError, ClosingStream, Service
from localpd.constrain.grammar import GrammarError, check, choice_pattern, regex_grammar, text_grammar
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle, TokenEvent
from localpd.engine.sampling import SamplingParams
from localpd.errors import LocalpdError
from localpd.text.chat_template import check_template_vars

log = logging.getLogger("localpd.api.app")

MAX_CHOICES = 16  # a request's prompts x n: each choice is a sequence in the engine


def openai_router(service: Service) -> APIRouter:
    router = APIRouter()

    def listed(m: ServedModel) -> dict:
        return {"id": m.id, "object": "model", "created": 0, "owned_by": "localpd",
                **({"max_model_len": m.context} if m.context else {})}

    @router.get("/v1/models")
    async def models():
        """Every model served, loaded or not (max_model_len: once it has loaded)."""
        return {"object": "list", "data": [listed(m) for m in list(service.pool.models.values())]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return listed(service.served(model_id))

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt, or of a conversation in the model's chat template (vLLM's and llama.cpp's)."""
        e = await service.engine(body.model)
        if e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer", param="prompt")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt")
        if body.messages is not None:
            ids = service.chat_prompt(e, text_messages(body.messages), body.chat_template_kwargs,
                                      add_generation_prompt=body.add_generation_prompt)
        else:
            ids = e.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": e.max_context}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        e = await service.engine(body.model)
        if e.tokenizer is None:
            raise ApiError(400, f"{e.name} has no tokenizer", param="tokens")
        bad = [t for t in body.tokens if not 0 <= t < e.config.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary of {e.config.vocab_size}",
                           param="tokens")
        return {"prompt": e.tokenizer.decode(body.tokens, skip_special=False)}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        e = await service.engine(body.model)
        log_unknown(body)
        messages = text_messages(body.messages)
        try:
            check_template_vars(body.chat_template_kwargs or {})
        except LocalpdError as err:
            raise ApiError(400, str(err), param="chat_template_kwargs") from None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        ids, reply, forced = service.tool_prompt(e, messages, tools, choice, body.chat_template_kwargs,
                                                 body.continue_final_message, body.parallel_tool_calls)
        top = body.top_logprobs if body.logprobs else None
        limit = body.max_completion_tokens or body.max_tokens
        return await respond(service, e, body, [ids], limit, None if not body.logprobs else (top or 0), chat=True,
                             reply=reply, forced=forced)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        e = await service.engine(body.model)
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
            return await respond(service, e, body, ids, body.max_tokens or 16, body.logprobs, chat=False)
        ids = [e.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        bad = [t for p in ids for t in p if not 0 <= t < e.config.vocab_size]
        if bad:  # before echo decodes them (the engine would refuse them too, after)
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary of {e.config.vocab_size}",
                           param="prompt")
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else e.tokenizer.decode(p) if e.tokenizer else "" for p in prompts]
        return await respond(service, e, body, ids, body.max_tokens or 16, body.logprobs, chat=False, echo=echo)

    @router.post("/v1/embeddings")
    async def embed(body: EmbeddingRequest):
        """Each input's last-token hidden state, L2-normalised (Engine.embed), as OpenAI's embeddings: floats, or
        base64 of little-endian float32 (what the openai client asks for by default)."""
        e = await service.engine(body.model)
        log_unknown(body)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise ApiError(400, "the input is empty", param="input")
        service.check_dimensions(e, body.dimensions)
        ids = service.embedding_ids(e, inputs)
        vectors = await service.embed(e, ids)

        def encoded(v: list[float]):
            return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if body.encoding_format == "base64" else v

        n = sum(map(len, ids))
        return {"object": "list", "model": e.name, "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]}

    return router


async def respond(service: Service, e: Engine, body: Sampling, prompts: list[list[int]], limit: int | None,
                  logprobs: int | None, chat: bool, reply=None, forced: tuple[str, dict] | None = None,
                  echo: list[str] | None = None):
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
        service.check_context(e, ids, limit, param=where)
    service.admit(e, len(prompts) * body.n)
    params, guided_field, schema_field = sampling_params(e, body, limit, logprobs, forced)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

    def blame(err: LocalpdError) -> str | None:
        return guided_field if err.param in ("regex", "grammar") else err.param or (
            None if params.json_schema is None else schema_field)

    handles = service.submit(e, prompts, params, body.n, rid, blame)
    replies = [reply() if reply else None for _ in handles]
    echoes = [echo[i // body.n] if echo else "" for i in range(len(handles))]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStream(stream(service, e, handles, body.n, rid, created, chat, include_usage, replies,
                                    echoes), media_type="text/event-stream")
    try:
        results = await asyncio.gather(*(service.collect(h, logprobs is not None) for h in handles))
    finally:
        for handle in handles:
            handle.cancel()
    choices = [choice(service, e, i, handle, r, result, chat, logprobs is not None, echoes[i], len(handles) > 1)
               for i, (handle, r, result) in enumerate(zip(handles, replies, results))]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": e.name, "choices": choices, "usage": usage(handles, body.n),
            "timings": service.timings(e, handles[0])}


def sampling_params(e: Engine, body: Sampling, limit: int | None, logprobs: int | None,
                    forced: tuple[str, dict] | None) -> tuple[SamplingParams, str | None, str]:
    """The sampler's parameters a request asks for; the field that gave a guided output, and the field that gave
    the JSON schema (what a refused schema or pattern is blamed on)."""
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
    guided_field, guided_schema, regex, grammar = guided(body)
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
        json_lead=forced[0] if forced else "", regex=regex, grammar=grammar, logit_bias=body.logit_bias or {},
        stop_token_ids=body.stop_token_ids or [], min_tokens=body.min_tokens, draft_tokens=body.speculative_n_max)
    return params, guided_field, schema_field


def choice(service: Service, e: Engine, i: int, handle: RequestHandle, r: Reply | None, result, chat: bool,
           logprobs: bool, echoed: str, several: bool) -> dict:
    """Choice i of a reply that was not streamed."""
    service.finished(e, handle)
    out = {"index": i, "finish_reason": finish_reason(result.finish_reason)}
    if chat:
        reasoning, content, found = r.whole(result.text)
        empty = not content and (found or reasoning)  # a reply that is all calls or all reasoning
        out["message"] = {"role": "assistant", "content": None if empty else content}
        if r.think is not None:
            out["message"]["reasoning_content"] = reasoning or None
        if found:
            out["message"]["tool_calls"] = found
            out["finish_reason"] = "tool_calls"
        out["logprobs"] = chat_logprobs(e, result.events) if logprobs else None
    else:
        out["text"] = echoed + result.text
        out["logprobs"] = completion_logprobs(e, result.events) if logprobs else None
    if several:
        out["timings"] = service.timings(e, handle)
    return out


async def stream(service: Service, e: Engine, handles: list[RequestHandle], n: int, rid: str, created: int,
                 chat: bool, include_usage: bool, replies: list[Reply | None], echoes: list[str]):
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
            each = {"choice_timings": [service.timings(e, h) for h in handles]} if len(handles) > 1 else {}
            yield chunk(None, usage=usage(handles, n), timings=service.timings(e, handles[0]), **each)
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        for handle in handles:
            handle.cancel()  # no-op when finished; frees the pages of a client that went away
            service.finished(e, handle)


def choice_chunks(e: Engine, i: int, ev: TokenEvent, reply: Reply | None, chat: bool) -> list[dict]:
    """The chunks' choices one event of choice i makes: its text (reasoning and answer apart), and at the end
    any tool calls."""
    reason = ev.finish_reason
    reasoning, text, found = ("", ev.text, []) if reply is None else (*reply.feed(ev.text), [])
    if reason is not None and reply is not None:
        more_reasoning, rest, found = reply.finish()
        reasoning, text = reasoning + more_reasoning, text + rest
    choice = {"index": i, "finish_reason": None if found else finish_reason(reason)}
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


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's shape gives it: a request the server's shutdown cut is vLLM's
    "abort" (one whose client went away has no one to tell)."""
    return "abort" if reason == "cancelled" else reason


def usage(handles: list[RequestHandle], n: int = 1) -> dict:
    """Each prompt counted once, as OpenAI counts it for its n choices, and the choices' tokens together;
    cached: the prompt tokens each prompt's first choice found in the prefix cache."""
    firsts = [h.stats for h in handles[::n]]
    prompt, out = sum(s.prompt_tokens for s in firsts), sum(h.stats.output_tokens for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


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


def text_messages(messages: list[Message]) -> list[dict]:
    """The messages as the chat template takes them; a part that is not text is a 400, not dropped in silence
    (the model would answer without the image it was asked about)."""
    parts = [p.type for m in messages if isinstance(m.content, list) for p in m.content if p.type != "text"]
    if parts:
        raise ApiError(400, f"the models localpd runs take text only; a {parts[0]!r} content part cannot be read",
                       param="messages")
    return [m.template_dict() for m in messages]


def guided(body: Sampling) -> tuple[str | None, dict | None, str | None, str | None]:
    """vLLM's structured outputs and llama.cpp's grammar as (the field that gave them, a JSON schema, a pattern the
    whole reply matches, a grammar (GBNF or Lark) it is a sentence of); at most one of them. One the grammar engine
    cannot compile is a 400 naming the field."""
    so = body.structured_outputs
    given = [(name, value) for name, value in (
        ("structured_outputs.json", so and so.json_), ("structured_outputs.regex", so and so.regex),
        ("structured_outputs.choice", so and so.choice), ("structured_outputs.grammar", so and so.grammar),
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar),
        ("grammar", body.grammar)) if value is not None]
    if not given:
        return None, None, None, None
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(n for n, _ in given)}", param=given[1][0])
    name, value = given[0]
    if name.endswith("json"):
        return name, value, None, None
    try:
        if name.endswith("grammar"):
            check(text_grammar(value))
            return name, None, None, value
        regex = choice_pattern(value) if name.endswith("choice") else value
        check(regex_grammar(regex))
    except GrammarError as err:
        raise ApiError(400, f"{name}: {err}", param=name) from None
    return name, None, regex, None


def log_unknown(body: Sampling) -> None:
    if body.model_extra:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))
