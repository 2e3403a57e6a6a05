"""The one error mapper of all three servers: every outcome of a call is a status we document.

Installed as a server interceptor (``error_interceptor`` on the sync verifier, ``aio_error_interceptor`` on
the asyncio coordinator and drafter), it wraps every method handler so that:

- the request is parsed here, from raw bytes: a corrupt message, or a string field that is not valid UTF-8,
  is INVALID_ARGUMENT "the request is not a valid <Message> ..." (gRPC's own deserializer failure reads as
  UNKNOWN or INTERNAL with a Python exception);
- a ``SpecserveError`` becomes its status, its message and its ``metadata`` as trailing metadata;
- any other exception is INTERNAL "internal error <ref>; the server logged it", and the traceback is logged
  with the same ref: a client never sees Python exception text, an operator can find the log line;
- an abort the handler made itself (``context.abort``) passes through untouched;
- work cancelled because its caller went away (``concurrent.futures.CancelledError``) is CANCELLED, not a bug.

Servicers therefore raise domain errors from ``specserve.errors`` and never call ``context.abort`` for them.
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import CancelledError
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from specserve.errors import InvalidArgument, SpecserveError

log = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]


def _message_name(deserializer: Deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "message"))


def _parser(deserializer: Deserializer | None) -> Callable[[bytes], Any]:
    """Raw bytes -> the request message; InvalidArgument when they are not one."""
    if deserializer is None:
        return lambda raw: raw
    name = _message_name(deserializer)

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, UnicodeDecodeError, ValueError, TypeError) as exc:
            raise InvalidArgument(
                f"the request is not a valid {name}: corrupt protobuf bytes, or a string field that is not valid UTF-8"
            ) from exc

    return parse


def _internal_message(method: str, exc: BaseException) -> str:
    ref = secrets.token_hex(4)
    log.error("internal error %s in %s", ref, method, exc_info=exc)
    return f"internal error {ref}; the server logged it"


def _status(exc: SpecserveError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[exc.status]
    except KeyError:
        return grpc.StatusCode.INTERNAL


# ---- sync servers (the verifier) ----


def _sync_fail(method: str, exc: Exception, context: grpc.ServicerContext) -> NoReturn:
    """Abort the call with the status ``exc`` maps to; an abort the handler already made is re-raised."""
    if context.code() is not None:  # the handler aborted (sync context.abort raises a plain Exception)
        raise exc
    if isinstance(exc, SpecserveError):
        if exc.metadata:
            context.set_trailing_metadata(exc.metadata)
        context.abort(_status(exc), str(exc))
    if isinstance(exc, CancelledError):  # the caller went away and its queued work was cancelled: no bug
        context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
    context.abort(grpc.StatusCode.INTERNAL, _internal_message(method, exc))
    raise AssertionError("context.abort returned")


def _sync_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = _parser(handler.request_deserializer)

    def parsed(raw_requests: Iterator[bytes]) -> Iterator[Any]:
        for raw in raw_requests:
            yield parse(raw)

    def call(behavior: Callable[..., Any], request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except Exception as exc:
            _sync_fail(method, exc, context)

    def stream(behavior: Callable[..., Iterator[Any]], request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except Exception as exc:
            _sync_fail(method, exc, context)

    def unparsed(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return parse(request)
        except Exception as exc:
            _sync_fail(method, exc, context)

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary
        return handler._replace(
            request_deserializer=None,
            unary_unary=lambda raw, ctx: call(inner_uu, unparsed(raw, ctx), ctx),
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream
        return handler._replace(
            request_deserializer=None,
            unary_stream=lambda raw, ctx: stream(inner_us, unparsed(raw, ctx), ctx),
        )
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary
        return handler._replace(
            request_deserializer=None,
            stream_unary=lambda raws, ctx: call(inner_su, parsed(raws), ctx),
        )
    inner_ss = handler.stream_stream
    assert inner_ss is not None
    return handler._replace(
        request_deserializer=None,
        stream_stream=lambda raws, ctx: stream(inner_ss, parsed(raws), ctx),
    )


class ErrorInterceptor(grpc.ServerInterceptor):
    """The error mapper for a sync ``grpc.server``."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _sync_handler(handler_call_details.method, handler)


# ---- asyncio servers (the coordinator, the drafter) ----


async def _aio_fail(method: str, exc: Exception, context: grpc.aio.ServicerContext) -> NoReturn:
    if isinstance(exc, SpecserveError):
        await context.abort(_status(exc), str(exc), trailing_metadata=exc.metadata)
    if isinstance(exc, CancelledError):
        await context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
    await context.abort(grpc.StatusCode.INTERNAL, _internal_message(method, exc))
    raise AssertionError("context.abort returned")


def _is_async(behavior: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def _aio_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler wrapped; a sync behavior (grpc's own health service) is left as it is.

    The wrappers must be ``async def`` functions: grpc.aio runs any other handler in a thread pool.
    """
    parse = _parser(handler.request_deserializer)

    async def parsed(raw_requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in raw_requests:
            yield parse(raw)

    async def call(behavior: Callable[..., Awaitable[Any]], request: Callable[[], Any], context: Any) -> Any:
        try:
            return await behavior(request(), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _aio_fail(method, exc, context)

    async def stream(behavior: Callable[..., Any], request: Callable[[], Any], context: Any) -> AsyncIterator[Any]:
        try:
            result = behavior(request(), context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            else:  # a coroutine that writes with context.write
                await result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _aio_fail(method, exc, context)

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary
        if not _is_async(inner_uu):
            return handler

        async def unary_unary(raw: bytes, context: Any) -> Any:
            return await call(inner_uu, lambda: parse(raw), context)

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream
        if not _is_async(inner_us):
            return handler

        async def unary_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            async for response in stream(inner_us, lambda: parse(raw), context):
                yield response

        return handler._replace(request_deserializer=None, unary_stream=unary_stream)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary
        if not _is_async(inner_su):
            return handler

        async def stream_unary(raws: AsyncIterator[bytes], context: Any) -> Any:
            return await call(inner_su, lambda: parsed(raws), context)

        return handler._replace(request_deserializer=None, stream_unary=stream_unary)
    inner_ss = handler.stream_stream
    if inner_ss is None or not _is_async(inner_ss):
        return handler

    async def stream_stream(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        async for response in stream(inner_ss, lambda: parsed(raws), context):
            yield response

    return handler._replace(request_deserializer=None, stream_stream=stream_stream)


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """The error mapper for a ``grpc.aio.server``."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _aio_handler(handler_call_details.method, handler)
