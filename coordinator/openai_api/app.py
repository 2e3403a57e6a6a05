"""The OpenAI-compatible HTTP API of the coordinator (FastAPI): routes, request parsing, error handlers.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health`` (200 once the coordinator serves, 503 while it starts or drains; no key needed).

Each generation goes through the same ``GenerationFrontend`` as the gRPC API (checks, admission, deadline,
metrics, the request's log line), so both APIs give the same tokens for the same request. Its admission slot is
taken before the body is read: a request the coordinator has no room for is refused before its megabytes are.
Every response carries ``X-Request-Id``: the client's own when it is sane, else a new one; it is also the ``id``
of the completion and the key of the request's log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.admission import Slot
from coordinator.frontend import CallInfo, EdgeRequest, request_id
from coordinator.openai_api.auth import authenticate
from coordinator.openai_api.errors import ApiError, as_api_error, from_domain
from coordinator.openai_api.responses import (
    ChatRenderer,
    CompletionRenderer,
    Event,
    GenerationResponse,
    Renderer,
    send_error,
)
from coordinator.openai_api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from coordinator.openai_api.translate import chat_request, completion_request, include_usage
from coordinator.prompts import PromptLimits
from specserve.auth.keys import ApiKeys
from specserve.call_limit import CallLimit
from specserve.drain import Drain
from specserve.errors import SpecserveError
from specserve.tenancy import Tenant

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "specserve.request_id"
"""Where the request's id lives in the ASGI scope."""
PARSE_IN_THREAD_BYTES = 256 << 10
"""Bodies larger than this are parsed in a worker thread, so a multi-megabyte prompt does not stall the loop."""


class Frontend(Protocol):
    """What the HTTP API needs of ``coordinator.frontend.GenerationFrontend``."""

    served_model: str

    @property
    def ready(self) -> bool: ...

    @property
    def limits(self) -> PromptLimits | None: ...

    async def admit(self, call: CallInfo) -> Slot: ...

    def generate(self, request: EdgeRequest, call: CallInfo, slot: Slot | None = None) -> AsyncIterator[Event]: ...


def max_body_bytes(max_prompt_bytes: int) -> int:
    """Largest request body taken: room for a prompt at --max-prompt-bytes even when JSON escapes every character
    as ``\\uXXXX`` (3x its UTF-8 size for any character outside the control range), plus 1 MiB for the rest."""
    return 3 * max_prompt_bytes + (1 << 20)


class RequestIdMiddleware:
    """Gives each request its id (``X-Request-Id`` on every response) and turns an unhandled bug into a 500.

    A pure ASGI middleware, so streaming responses pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        client_value = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                client_value = value.decode("latin-1")
        rid = request_id(client_value)
        scope[REQUEST_ID_KEY] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self._app(scope, receive, send_with_id)
        except Exception as exc:
            error = as_api_error(exc, f"{scope.get('method')} {scope.get('path')} (request {rid})")
            if not started:
                await send_error(send_with_id, error)


class CallLimitMiddleware:
    """Counts the HTTP API's calls (``/health`` aside) against a ``CallLimit``: one past it gets our 429 JSON error
    with ``Retry-After``, before uvicorn's ``limit_concurrency`` backstop would answer its plain-text 503.

    Inside ``RequestIdMiddleware``, so the refusal carries ``X-Request-Id`` too; a streamed answer counts until
    its last chunk.
    """

    def __init__(self, app: ASGIApp, limit: CallLimit) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            await self._app(scope, receive, send)
            return
        try:
            self._limit.enter()
        except SpecserveError as exc:
            await send_error(send, from_domain(exc))
            return
        try:
            await self._app(scope, receive, send)
        finally:
            self._limit.leave()


def _json(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """A 400 naming the first problem of a request body that does not fit the schema."""
    errors = exc.errors()
    first = errors[0]
    where = _location(tuple(first.get("loc", ())))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError.invalid(f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if kind == "extra_forbidden":
        return ApiError.invalid(
            f"unrecognized request argument supplied: {where}{more}", param=where, code="unrecognized_argument"
        )
    if kind == "missing":
        return ApiError.invalid(f"missing required parameter: {where}{more}", param=where, code="missing_parameter")
    if not where:
        return ApiError.invalid(f"the request body must be a JSON object ({first.get('msg', '')})")
    return ApiError.invalid(f"invalid value for {where}: {first.get('msg', '')}{more}", param=where)


Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes (without reading it all)."""
    too_large = ApiError(
        413,
        f"the request body is over {limit} bytes; send a shorter prompt (see the coordinator's --max-prompt-bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(body: bytes, model: type[Body]) -> Body:
    try:
        if len(body) > PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def create_app(
    frontend: Frontend,
    keys: ApiKeys | None = None,
    drain: Drain | None = None,
    max_prompt_bytes: int = 4 << 20,
    clock: Callable[[], float] = time.time,
    call_limit: CallLimit | None = None,
) -> FastAPI:
    """The ASGI app; ``keys`` None: no authentication (the coordinator allows that on loopback only);
    ``call_limit`` None: no count of calls (uvicorn's own ``limit_concurrency`` alone)."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(clock())
    limit = max_body_bytes(max_prompt_bytes)

    def in_flight() -> AbstractContextManager[Any]:
        return drain.in_flight() if drain is not None else contextlib.nullcontext()

    def caller(request: Request) -> Tenant:
        return authenticate(keys, request.headers.get("authorization"))

    def check_model(model: str) -> None:
        if model != frontend.served_model:
            raise ApiError(
                404,
                f"the model {model!r} does not exist: this server serves {frontend.served_model!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def generation(
        request: Request, schema: type[ChatCompletionRequest] | type[CompletionRequest], api: str
    ) -> GenerationResponse:
        tenant = caller(request)
        if drain is not None:
            drain.refuse_new("new requests")
        rid = request.scope[REQUEST_ID_KEY]
        call = CallInfo(request_id=rid, api=api, tenant=tenant)
        slot = await frontend.admit(call)  # before the body: a request with no room costs no read and no parse
        try:
            body: ChatCompletionRequest | CompletionRequest = await parse(await read_body(request, limit), schema)
            check_model(body.model)
            renderer: Renderer
            if isinstance(body, ChatCompletionRequest):
                edge = chat_request(body, frontend.limits)
                renderer = ChatRenderer(f"chatcmpl-{rid}", frontend.served_model, int(clock()), include_usage(body))
            else:
                assert isinstance(body, CompletionRequest)
                edge = completion_request(body, frontend.limits)
                renderer = CompletionRenderer(f"cmpl-{rid}", frontend.served_model, int(clock()), include_usage(body))
            events = frontend.generate(edge, call, slot)
        except BaseException:
            slot.release()
            raise
        return GenerationResponse(
            events, renderer, stream=bool(body.stream), in_flight=in_flight, on_close=slot.release
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> GenerationResponse:
        return await generation(request, ChatCompletionRequest, "openai.chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> GenerationResponse:
        return await generation(request, CompletionRequest, "openai.completions")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        caller(request)
        return JSONResponse(ModelList(data=[ModelCard(id=frontend.served_model, created=started)]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        caller(request)
        check_model(model)
        return JSONResponse(ModelCard(id=frontend.served_model, created=started).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if drain is not None and drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not frontend.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return _json(exc)

    async def on_domain_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, SpecserveError)
        return _json(from_domain(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"unknown URL {where}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions",
                code="unknown_url",
            )
        elif exc.status_code == 405:
            error = ApiError(405, f"{where}: method not allowed", code="method_not_allowed", headers=exc.headers)
        else:
            error = ApiError(exc.status_code, f"{where}: {exc.detail}", headers=exc.headers)
        return _json(error)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _json(validation_error(exc))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(SpecserveError, on_domain_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    if call_limit is not None:
        app.add_middleware(CallLimitMiddleware, limit=call_limit)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost
    return app
