"""The HTTP route table over `OpenAIServer` (serving/openai_api.py): FastAPI, nothing else.

Each route checks the API key, reads the body under the size limit, hands off to
the server and shapes the response. The routes read the raw body (the server
validates strictly, with OpenAI-style errors), so FastAPI cannot see the request
models; `openapi()` puts them, and every error status, into `/openapi.json`,
which is what clients and the schema-driven fuzz test (tests/serving/test_fuzz.py)
read.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from serving.openai_api import OpenAIServer
from serving.openai_models import APIError, ChatCompletionRequest, CompletionRequest
from serving.prom import CONTENT_TYPE

REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorBody(BaseModel):
    """Every error: `{"error": {message, type, code, param}}` (OpenAI's shape)."""

    error: ErrorDetail


def _errors(*statuses: int) -> dict:
    what = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
            408: "request timed out", 413: "body over `serving.max_request_bytes`",
            415: "the body is not sent as JSON (`Content-Type: application/json`)",
            429: "queue full or the key's concurrency limit reached (Retry-After)",
            500: "engine error", 503: "shutting down, draining or unavailable (Retry-After)"}
    return {s: {"model": ErrorBody, "description": what[s]} for s in statuses}


GENERATE_RESPONSES = {
    200: {"description": "the completion, or server-sent events when `stream` is true",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **_errors(400, 401, 404, 408, 413, 415, 429, 500, 503),
}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise APIError(400, "malformed Content-Length header", code="invalid_request") from None
        if too_big:
            raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json`, or a `+json` type): a form
    post of a JSON-looking body is not served as if it were JSON."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"The body must be JSON sent as Content-Type: application/json, not "
                       f"{declared or 'no Content-Type'!r}", code="unsupported_media_type")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds this server's limit of {limit} bytes",
                    code="request_too_large")


def openapi(app: FastAPI, server: OpenAIServer) -> dict:
    """FastAPI's schema plus the request models (their `$defs` as components), with what this
    server accepts filled in: its model id, its context length, its vocabulary."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_MODELS.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = _served(body, server)
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for param in schema["paths"]["/v1/models/{model_id}"]["get"].get("parameters", []):
            param["schema"]["enum"] = [server.settings.model_name]      # the one model it serves
        app.openapi_schema = schema
    return app.openapi_schema


def _served(body: dict, server: OpenAIServer) -> dict:
    props, s = body["properties"], server.settings
    props["model"] = {"anyOf": [{"enum": [s.model_name]}, {"type": "null"}], "default": None}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name]["anyOf"][0]["maximum"] = s.max_context - 1
    if "prompt" in props:  # token ids index the vocabulary
        _bound_integers(props["prompt"], 0, server.vocab_size - 1)
    return body


def _bound_integers(schema, lo: int, hi: int) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema.update(minimum=lo, maximum=hi)
        for v in schema.values():
            _bound_integers(v, lo, hi)
    elif isinstance(schema, list):
        for v in schema:
            _bound_integers(v, lo, hi)


async def generate_response(server: OpenAIServer, request: Request, model, handler):
    """A generation route: checks, parses into `model`, runs `handler`; JSON or an SSE stream."""
    t0 = time.monotonic()
    client = server.check_api_key(request.headers.get("authorization"))
    server.check_admitting()
    check_json_content_type(request)
    req = server.parse(await read_body(request, server.settings.max_request_bytes), model)
    result = await handler(req, request.is_disconnected, client)
    if isinstance(result, dict):
        server.stats.observe_request(request.url.path, 200, time.monotonic() - t0)
        return JSONResponse(result)

    async def body():
        try:
            async for event in result:
                yield event
        finally:
            server.stats.observe_request(request.url.path, 200, time.monotonic() - t0)
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def build_fastapi_app(server: OpenAIServer) -> FastAPI:
    """The route table: each route parses, hands off to `server`, and shapes the response."""
    app = FastAPI(title="specflash", docs_url=None, redoc_url=None)
    s = server.settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        server.stats.observe_request(request.url.path, exc.status, 0.0)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/v1/completions", responses=GENERATE_RESPONSES)
    async def completions(request: Request):
        return await generate_response(server, request, CompletionRequest, server.completions)

    @app.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
    async def chat_completions(request: Request):
        return await generate_response(server, request, ChatCompletionRequest, server.chat)

    @app.get("/v1/models", responses=_errors(401))
    async def models(request: Request):
        server.check_api_key(request.headers.get("authorization"))
        return server.models()

    @app.get("/v1/models/{model_id}", responses=_errors(401, 404))
    async def model(model_id: str, request: Request):
        server.check_api_key(request.headers.get("authorization"))
        return server.model(model_id)

    @app.get("/health", responses={**_errors(401),
                                   503: {"description": "not ready, or draining for shutdown"}})
    async def health(request: Request):
        if s.auth_health:
            server.check_api_key(request.headers.get("authorization"))
        status, body = await server.health()
        return JSONResponse(body, status_code=status,
                            headers={} if status == 200 else {"Retry-After": "1"})

    @app.get("/metrics", responses={200: {"description": "Prometheus text format",
                                          "content": {CONTENT_TYPE: {}}}, **_errors(401)})
    async def metrics(request: Request):
        if s.auth_metrics:
            server.check_api_key(request.headers.get("authorization"))
        return Response(await server.metrics(), media_type=CONTENT_TYPE)

    app.openapi = lambda: openapi(app, server)
    return app
