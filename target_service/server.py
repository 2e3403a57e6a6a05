"""gRPC edge of the verifier: protobuf <-> domain types, nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack
from typing import TypeVar

import grpc

from specserve.auth.internal import session_owner
from specserve.drain import Drain
from specserve.errors import InvalidArgument, Unavailable
from specserve.results import VerifyResult
from specserve.tenancy import TENANT_METADATA_KEY
from specserve.token_masks import InvalidTokenMasksError
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from specserve.wire import (
    cost_to_proto,
    prefill_from_proto,
    prefill_result_to_proto,
    verify_call_from_proto,
    verify_result_to_proto,
)
from target_service.metrics import VerifierMetrics
from target_service.verifier import Verifier
from target_service.verify_stream import answer_stream

T = TypeVar("T")


def _owner(context: grpc.ServicerContext) -> str:
    """Who the call acts for (caller and tenant): a session answers only the owner that created it."""
    return session_owner(context.invocation_metadata(), context.peer_identities())


def _wait(future: Future[T], context: grpc.ServicerContext) -> T:
    """The engine's answer; a caller that goes away takes its queued call out of the queue."""
    context.add_callback(future.cancel)
    return future.result()


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    """Serves a Verifier once one is attached; until then every call is UNAVAILABLE.

    The server starts (and answers health checks as NOT_SERVING) before the
    model has loaded, so orchestrators can tell "loading" from "dead".
    """

    def __init__(self, metrics: VerifierMetrics, verifier: Verifier | None = None, drain: Drain | None = None) -> None:
        self._loaded: Verifier | None = None
        self._metrics = metrics
        self._drain = drain or Drain()
        if verifier is not None:
            self.attach(verifier)

    def attach(self, verifier: Verifier) -> None:
        self._metrics.track(verifier)
        self._loaded = verifier

    @property
    def _verifier(self) -> Verifier:
        if self._loaded is None:
            raise Unavailable("the verifier is still loading its model; retry shortly")
        return self._loaded

    def Prefill(
        self, request: verifier_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.PrefillResponse:
        call = prefill_from_proto(request)
        if not self._verifier.holds(call.session_id):  # draining: sessions held are in-flight streams' own
            self._drain.refuse_new("new sessions")
        with self._metrics.in_flight(), self._drain.in_flight():
            submitted = self._verifier.submit_prefill(
                call.session_id,
                list(call.token_ids),
                call.sampling,
                call.return_features,
                owner=_owner(context),
                feature_layers=call.feature_layers,
            )
            result = _wait(submitted, context)
        return prefill_result_to_proto(result)

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.VerifyResponse:
        return verify_result_to_proto(_wait(self._start_verify(request, _owner(context)), context))

    def VerifyStream(
        self, request_iterator: Iterator[verifier_pb2.VerifyStreamRequest], context: grpc.ServicerContext
    ) -> Iterator[verifier_pb2.VerifyStreamResponse]:
        identities = context.peer_identities()

        def start(request: verifier_pb2.VerifyRequest, tenant: str) -> Future[VerifyResult]:
            return self._start_verify(request, session_owner(((TENANT_METADATA_KEY, tenant),), identities))

        return answer_stream(request_iterator, context, start)

    def _start_verify(self, request: verifier_pb2.VerifyRequest, owner: str) -> Future[VerifyResult]:
        """Check ``request`` and queue it for the engine; counted in flight (metrics, drain) until it completes."""
        try:
            call = verify_call_from_proto(request)
        except InvalidTokenMasksError as exc:
            raise InvalidArgument(str(exc)) from exc
        verifier = self._verifier
        in_flight = ExitStack()
        in_flight.enter_context(self._metrics.in_flight())
        in_flight.enter_context(self._drain.in_flight())
        try:
            submitted = verifier.submit_verify(
                call.session_id,
                call.num_committed,
                call.tree,
                call.num_successors,
                call.return_features,
                owner=owner,
                token_masks=call.token_masks,
                draft_ns=call.draft_ns,
                lookahead=call.lookahead,
            )
        except BaseException:
            in_flight.close()
            raise
        submitted.add_done_callback(lambda _: in_flight.close())
        return submitted

    def Release(
        self, request: verifier_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.ReleaseResponse:
        released = self._verifier.release(request.session_id, owner=_owner(context))
        return verifier_pb2.ReleaseResponse(released=released)

    def VerifierInfo(
        self, request: verifier_pb2.VerifierInfoRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierInfoResponse:
        limits = self._verifier.limits
        stats = self._verifier.stats()
        return verifier_pb2.VerifierInfoResponse(
            model_name=self._verifier.model_name,
            vocab_fingerprint=self._verifier.vocab_fingerprint,
            vocab_size=self._verifier.vocab_size,
            max_tree_nodes=limits.max_tree_nodes,
            max_tree_depth=limits.max_tree_depth,
            max_sessions=limits.max_sessions,
            max_session_tokens=limits.max_session_tokens,
            supports_branching=self._verifier.supports_branching,
            device=str(self._verifier.device),
            num_active_sessions=stats.num_sessions,
            dtype=self._verifier.dtype,
            kv_cache_capacity_bytes=stats.kv_capacity_bytes,
            kv_cache_used_bytes=stats.kv_used_bytes,
            num_queued_requests=stats.num_queued,
            max_batch_tokens=limits.max_batch_tokens,
            verify_cost=cost_to_proto(self._verifier.cost_curve.verify_cost()),
        )
