"""Domain errors with the status a gRPC edge should report for each.

Domain code raises these; each service's server.py maps ``status`` to a
grpc.StatusCode, so algorithms never import grpc.
"""

from __future__ import annotations


class SpecserveError(Exception):
    """Base class; ``status`` names a grpc.StatusCode member.

    The message (``str(exc)``) is what a client sees: a short cause it can act on, never an internal address,
    a peer's own error text or a library's message. Those go in ``detail``, which only the service's log gets
    (under the request id). ``metadata`` goes to the client as trailing metadata with the status
    (``retry-after-ms`` on an overload). ``param`` names the request field the error is about, as the caller's
    API spells it (the HTTP API's ``param``); None when it is about no one field or the edge names none.
    """

    status = "INTERNAL"

    def __init__(
        self,
        message: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
        detail: str = "",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.metadata = metadata
        self.detail = detail
        self.param = param


class InvalidArgument(SpecserveError):
    status = "INVALID_ARGUMENT"


class NotFound(SpecserveError):
    status = "NOT_FOUND"


class FailedPrecondition(SpecserveError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(SpecserveError):
    status = "RESOURCE_EXHAUSTED"


class Unavailable(SpecserveError):
    status = "UNAVAILABLE"


class Unauthenticated(SpecserveError):
    status = "UNAUTHENTICATED"


class PermissionDenied(SpecserveError):
    status = "PERMISSION_DENIED"


class DeadlineExceeded(SpecserveError):
    status = "DEADLINE_EXCEEDED"


# The coordinator's failures of its workers: handled by the round loop (a dropped drafter, a re-prefill on
# another replica); a client sees them only as UNAVAILABLE when nothing is left to fall back on.


class DrafterFailed(SpecserveError):
    """The drafter cannot serve this session any more; decoding goes on without it."""

    status = "UNAVAILABLE"


class DrafterSkipped(DrafterFailed):
    """The drafter failed recently and is skipped until a probe finds it healthy (the message says until when)."""


class DrafterDraining(DrafterFailed):
    """A drafter is shutting down: it refused a new session, which another drafter of the tier may take.

    Not a failure of the tier: it opens no circuit.
    """


class ReplicaUnreachable(Unavailable):
    """A verifier replica could not be reached (connection refused or reset): it went down with its sessions."""


class ReplicaDraining(Unavailable):
    """A verifier replica is shutting down: it serves the sessions it holds but takes no new one."""


class SessionMoved(Unavailable):
    """The session's replica failed and the session now belongs to another replica: prefill it again there."""
