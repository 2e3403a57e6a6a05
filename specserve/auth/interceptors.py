"""Server interceptors: API keys on the coordinator, the internal token on the verifier and drafters.

Health checks (grpc.health.v1) stay open: orchestrators probe without credentials. A rejected call gets its
status before its handler runs; an accepted one runs its handler inside ``tenant_scope`` of the caller's tenant
(the context variable is set in the handler's own execution context, async generators included).
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from specserve.auth.keys import ApiKeys
from specserve.tenancy import Tenant, tenant_scope

HEALTH_PREFIX = "/grpc.health.v1.Health/"
MISSING_KEY = "send an API key as `authorization: Bearer <key>`"
UNKNOWN_KEY = (
    "the API key is unknown or was revoked: check it (the coordinator stores its SHA-256 in --api-keys-file) "
    "or ask for a new one"
)
KEYS_REVOKED = (
    "every API key is revoked: the coordinator's API key file (--api-keys-file) has been removed; "
    "ask the operator to restore it"
)
MISSING_TOKEN = "internal service: send the internal token as `authorization: Bearer <token>` (--internal-token-file)"
WRONG_TOKEN = "internal service: the internal token is wrong: give the caller the same --internal-token-file"


def bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _same_kind(handler: Any, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A method handler of ``handler``'s kind (streaming or not, each way) running ``behavior``."""
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **codec)
    return grpc.unary_unary_rpc_method_handler(behavior, **codec)


def _behavior(handler: Any) -> Callable[..., Any]:
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream
    if handler.request_streaming:
        return handler.stream_unary
    if handler.response_streaming:
        return handler.unary_stream
    return handler.unary_unary


def _aio_rejection(handler: Any, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return _same_kind(handler, reject)


def _sync_rejection(handler: Any, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def reject(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    return _same_kind(handler, reject)


def in_tenant_scope(handler: Any, tenant: Tenant) -> grpc.RpcMethodHandler:
    """``handler`` (an asyncio one) running inside ``tenant_scope(tenant)``."""
    behavior = _behavior(handler)
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with tenant_scope(tenant):
                async for item in behavior(request, context):
                    yield item

        return _same_kind(handler, stream)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with tenant_scope(tenant):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

    return _same_kind(handler, call)


def refusal(keys: ApiKeys) -> str:
    """Why a key was refused: the file is gone (every key revoked) or this key is not in it."""
    return KEYS_REVOKED if keys.revoked else UNKNOWN_KEY


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The coordinator's edge: ``authorization: Bearer <api key>`` -> the key's tenant, or UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        key = bearer(handler_call_details.invocation_metadata)
        if key is None:
            return _aio_rejection(handler, grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)
        principal = self._keys.lookup(key)
        if principal is None:
            return _aio_rejection(handler, grpc.StatusCode.UNAUTHENTICATED, refusal(self._keys))
        return in_tenant_scope(handler, principal.tenant)


def token_problem(token: str, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """Why the call's internal token is not ``token`` (compared in constant time), or None when it is."""
    presented = bearer(metadata)
    if presented is None:
        return MISSING_TOKEN
    if not hmac.compare_digest(presented.encode(), token.encode()):
        return WRONG_TOKEN
    return None


class InternalTokenInterceptor(grpc.ServerInterceptor):
    """The verifier's (sync server's) check of the coordinator's internal token."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        problem = token_problem(self._token, handler_call_details.invocation_metadata)
        if problem is not None:
            return _sync_rejection(handler, grpc.StatusCode.UNAUTHENTICATED, problem)
        return handler


class AioInternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """The drafter's (asyncio server's) check of the coordinator's internal token."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        problem = token_problem(self._token, handler_call_details.invocation_metadata)
        if problem is not None:
            return _aio_rejection(handler, grpc.StatusCode.UNAUTHENTICATED, problem)
        return handler
