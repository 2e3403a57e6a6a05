"""Domain errors with the status a gRPC edge should report for each.

Domain code raises these; each service's server.py maps ``status`` to a
grpc.StatusCode, so algorithms never import grpc.
"""

from __future__ import annotations


class SpecserveError(Exception):
    """Base class; ``status`` names a grpc.StatusCode member.

    ``metadata`` goes to the client as trailing metadata with the status (``retry-after-ms`` on an overload).
    """

    status = "INTERNAL"

    def __init__(self, message: str = "", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.metadata = metadata


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
