"""OpenAI's error body and status codes, from specserve's domain errors.

Every failure of the HTTP API answers ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI's clients expect (they pick their exception class by status, and retry 429 and 5xx):

=====================  ======  =====================  ======================
specserve.errors       status  type                   code
=====================  ======  =====================  ======================
InvalidArgument        400     invalid_request_error  invalid_argument
FailedPrecondition     400     invalid_request_error  failed_precondition
Unauthenticated        401     invalid_request_error  invalid_api_key
PermissionDenied       403     permission_error       permission_denied
NotFound               404     invalid_request_error  not_found
ResourceExhausted      429     rate_limit_error       rate_limit_exceeded
(any other)            500     server_error           internal_error
Unavailable            503     server_error           unavailable
DeadlineExceeded       504     server_error           timeout
=====================  ======  =====================  ======================

A 429 carries ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (OpenAI's client reads it first)
from the error's ``retry-after-ms`` metadata. A bug is a 500 "internal error <ref>; the server logged it": the
traceback goes to the log under the same ref, never to the client.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from specserve.errors import SpecserveError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kind:
    status: int
    type: str
    code: str


_KINDS = {
    "INVALID_ARGUMENT": _Kind(400, "invalid_request_error", "invalid_argument"),
    "FAILED_PRECONDITION": _Kind(400, "invalid_request_error", "failed_precondition"),
    "OUT_OF_RANGE": _Kind(400, "invalid_request_error", "invalid_argument"),
    "UNAUTHENTICATED": _Kind(401, "invalid_request_error", "invalid_api_key"),
    "PERMISSION_DENIED": _Kind(403, "permission_error", "permission_denied"),
    "NOT_FOUND": _Kind(404, "invalid_request_error", "not_found"),
    "RESOURCE_EXHAUSTED": _Kind(429, "rate_limit_error", "rate_limit_exceeded"),
    "CANCELLED": _Kind(499, "invalid_request_error", "cancelled"),
    "INTERNAL": _Kind(500, "server_error", "internal_error"),
    "UNAVAILABLE": _Kind(503, "server_error", "unavailable"),
    "DEADLINE_EXCEEDED": _Kind(504, "server_error", "timeout"),
}


class ApiError(Exception):
    """An error of the HTTP API itself (a bad field, an unknown model, a missing key), with OpenAI's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str = "invalid_argument") -> ApiError:
        """A 400: the request cannot be served as sent; ``message`` says what to change."""
        return cls(400, message, param=param, code=code)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()

    def event(self) -> bytes:
        """The error as a server-sent event, for a failure after the stream began (then ``data: [DONE]``)."""
        return b"data: " + self.json() + b"\n\n"


def retry_headers(error: SpecserveError) -> dict[str, str]:
    """``Retry-After`` (seconds, at least 1) and ``retry-after-ms`` from a refusal's ``retry-after-ms`` metadata."""
    for key, value in error.metadata:
        if key == "retry-after-ms":
            try:
                ms = max(0, int(value))
            except ValueError:
                return {}
            return {"retry-after": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}
    return {}


def from_domain(error: SpecserveError, param: str | None = None) -> ApiError:
    """The OpenAI-shaped error of a domain error (``specserve.errors``); ``param`` defaults to the error's own."""
    kind = _KINDS.get(error.status, _KINDS["INTERNAL"])
    if kind.status == 500:  # a SpecserveError that says INTERNAL is a bug that was named: still no details out
        return internal(error)
    param = error.param if param is None else param
    return ApiError(kind.status, str(error), kind.type, param, kind.code, retry_headers(error))


def internal(exc: BaseException, where: str = "the HTTP API") -> ApiError:
    """A 500 for a bug: the client gets a ref, the log gets the traceback with the same ref."""
    ref = secrets.token_hex(4)
    log.error("internal error %s in %s", ref, where, exc_info=exc)
    kind = _KINDS["INTERNAL"]
    return ApiError(kind.status, f"internal error {ref}; the server logged it", kind.type, None, kind.code)


def as_api_error(exc: BaseException, where: str = "the HTTP API") -> ApiError:
    """Any exception as the error the client gets."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SpecserveError):
        return from_domain(exc)
    return internal(exc, where)
