"""Request bodies read as JSON whatever their Content-Type says (missing, text/plain, a form: what `curl -d` and
litellm's Ollama providers send), as Ollama reads them; unpaired UTF-16 surrogates ("\\ud800", what a JS client sends
after cutting a string inside an emoji) replaced by U+FFFD, so no text field reaches the tokenizer unencodable."""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Receive, Scope, Send

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(value):
    """value (parsed JSON) with each lone surrogate in its strings and keys replaced; json.loads joins the pairs."""
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    return value


def cleaned(body: bytes) -> bytes:
    """The body, its lone surrogates replaced; as it came when it has none or is not JSON (a 400 further in)."""
    if not SURROGATE_ESCAPE.search(body):
        return body
    try:
        value = json.loads(body)
    except ValueError:
        return body
    fixed = without_surrogates(value)
    return body if fixed == value else json.dumps(fixed).encode()


class JsonBodies:
    """ASGI middleware: a POST's (or DELETE's) body is labelled application/json and cleaned of lone surrogates; the
    route's own parsing makes a body that is not JSON a 400."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "DELETE"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, given = cleaned(b"".join(chunks)), False

        async def replay() -> dict:
            nonlocal given
            if given:
                return await receive()  # the disconnect a streaming response listens for
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await self.app({**scope, "headers": headers}, replay, send)
