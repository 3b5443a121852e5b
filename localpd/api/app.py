"""`localpd serve`'s app: the OpenAI-compatible API (localpd.api.openai, and its Responses API in
localpd.api.responses), Anthropic's Messages API (localpd.api.anthropic) and Ollama's (localpd.api.ollama) over one
service (localpd.api.service), on loopback by default. Bodies are read as JSON whatever their Content-Type
(localpd.api.body).

A client that goes away mid-stream cancels its request, which frees its KV pages at the engine's next step. Errors
always have OpenAI's shape {"error": {"message", "type", "param", "code"}}, under /api/ Ollama's {"error": "..."},
under /v1/messages Anthropic's {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from localpd.api.anthropic import anthropic_router
from localpd.api.body import JsonBodies
from localpd.api.ollama import ollama_router
from localpd.api.openai import openai_router
from localpd.api.responses import responses_router
from localpd.api.schemas import error_body
from localpd.api.models import ModelPool, ServedModel, held_by_request
from localpd.api.service import ApiError, Service
from localpd.engine import Engine

log = logging.getLogger("localpd.api.app")

MAX_BODY = 10 * 2**20


def create_app(models: Engine | ModelPool, api_key: str | None = None, max_waiting: int = 64,
               bandwidth: float | None = None, split_reasoning: bool = True,
               cors_origins: list[str] | None = None) -> FastAPI:
    """models: the models served (localpd.api.models; the first loads now, /health says 503 until it has), or one
    engine, loaded, served under its name.
    split_reasoning: a thinking model's <think> block goes to the message's reasoning_content, not its content.
    cors_origins: web origins whose pages may call the API from a browser ("*": any); their preflight requests
    are answered before the API key is asked for, as browsers send them without it.
    bandwidth: bytes/s the MBU in `timings` and /metrics is measured against (default: the device's measured
    copy bandwidth, else its datasheet peak; localpd.measure.device)."""
    app = FastAPI(title="localpd", version="0.1.0", description="OpenAI-compatible local inference")
    pool = models if isinstance(models, ModelPool) else ModelPool([ServedModel.of(models)])
    service = Service(pool, max_waiting, bandwidth, split_reasoning)
    app.state.service = service  # what `localpd serve` stops admitting and cuts at shutdown
    add_error_handlers(app)
    app.add_middleware(JsonBodies)  # inside the guard below: a refused request's body is not read

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path not in ("/health", "/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ") or request.headers.get(
                "x-api-key")  # Anthropic's clients send x-api-key
            if given != api_key:
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
        why = service.health()
        if why is not None:
            return JSONResponse({"status": "loading" if why == "loading" else "error",
                                 "error": None if why == "loading" else why}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return Response(service.metrics.render(pool.engines()), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(service))
    app.include_router(ollama_router(service))
    app.include_router(anthropic_router(service))
    app.include_router(responses_router(service))
    app.add_middleware(HeldModels, pool=pool)
    if cors_origins:  # added last, so it runs first: a browser's preflight carries no Authorization header
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


class HeldModels:
    """Holds the models a request looks up (ModelPool.acquire) until its response has been sent, a stream's
    last event included, so that none is unloaded under it; then releases them with the request's keep-alive."""

    def __init__(self, app, pool: ModelPool):
        self.app, self.pool = app, pool

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list = []
        token = held_by_request.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            held_by_request.reset(token)
            for m, keep_alive in held:
                self.pool.release(m, keep_alive)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error(request: Request, body: dict, status: int) -> JSONResponse:
    """OpenAI's error shape; under /api/ Ollama's ({"error": "..."}), under /v1/messages Anthropic's
    ({"type": "error", "error": {"type", "message"}})."""
    path = request.url.path
    if path.startswith("/api/"):
        body = {"error": body["error"]["message"]}
    elif path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                           "message": body["error"]["message"]}}
    return JSONResponse(body, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error(request, e.body, e.status)

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
