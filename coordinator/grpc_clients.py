"""The verifier and drafter ports over gRPC (asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from coordinator import deadlines, round_phases
from coordinator.ports import VerifierInfo
from coordinator.verify_stream import StreamCallFailed, StreamUnsupported, VerifyStreamMux
from specserve import errors
from specserve.auth.internal import ANONYMOUS_METADATA, Metadata
from specserve.drain import DRAINING_METADATA
from specserve.errors import DrafterDraining, DrafterFailed, ReplicaDraining, ReplicaUnreachable
from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.sampling import GREEDY, SamplingParams
from specserve.tenancy import current_tenant
from specserve.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specserve.verify_call import SessionPrefill, VerifyCall
from specserve.wire import (
    cost_from_proto,
    cost_to_proto,
    draft_reply_from_proto,
    features_to_proto,
    feedback_to_proto,
    prefill_result_from_proto,
    prefill_to_proto,
    sampling_to_proto,
    split_features,
    verified_tree_to_proto,
    verify_call_to_proto,
    verify_result_from_proto,
)

log = logging.getLogger(__name__)

PEER_STATUS_WAIT_S = 0.5
"""Longest wait for a peer's own status to replace the INTERNAL a failed write recorded (``peer_code``)."""
PEER_STATUS_POLL_S = 0.01


async def peer_code(call: grpc.aio.Call) -> grpc.StatusCode:
    """An ended call's status code, the peer's own where a failed write stood in for it.

    A write that meets a call the peer has already ended fails in gRPC core, and grpc.aio then records INTERNAL
    ("Failed execute_batch"), with no trailers, as the call's status; the peer's status, received on its own,
    replaces it once its completion is delivered, usually within a few turns of the event loop. So an INTERNAL
    here is waited on, for at most PEER_STATUS_WAIT_S, before it is believed.
    """
    code = await call.code()
    for _ in range(round(PEER_STATUS_WAIT_S / PEER_STATUS_POLL_S)):
        if code != grpc.StatusCode.INTERNAL:
            break
        await asyncio.sleep(PEER_STATUS_POLL_S)
        code = await call.code()
    return code


FEATURE_CHUNK_BYTES = 1 << 20
"""Most float16 feature bytes in one Draft stream message.

A long prompt's features (1,152 bytes per token at SmolLM2's hidden size) would pass gRPC's default 4 MiB
message limit, which the drafter's server keeps; 1 MiB slices stay well under it with room for the rest of a
ProposeTree, and are few enough (about 7 for a 6,000-token prompt) that their overhead does not matter.
"""

# A verifier's refusals, as the domain errors they are and what a client reads of them; the verifier's own message
# (written for operators: flags, limits) goes to the log as the error's detail.
_VERIFIER_REFUSALS: dict[grpc.StatusCode, tuple[type[errors.SpecserveError], str]] = {
    grpc.StatusCode.NOT_FOUND: (errors.NotFound, "the verifier no longer holds this request's session"),
    grpc.StatusCode.FAILED_PRECONDITION: (
        errors.FailedPrecondition,
        "the verifier cannot serve this request's session now",
    ),
    grpc.StatusCode.INVALID_ARGUMENT: (errors.InvalidArgument, "the verifier refused this request's input"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        errors.ResourceExhausted,
        "the verifier has no room for this request now: retry later",
    ),
}


RELEASE_TIMEOUT_S = 5.0
"""Most a Release waits. Not bounded by the request's deadline: releasing is the clean-up after it passed."""


def _draining(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the refusal came from a server that is shutting down (``specserve.drain``)."""
    trailing = exc.trailing_metadata() or ()
    return any((key, value) in DRAINING_METADATA for key, value in trailing)


class GrpcVerifier:
    """``metadata()``: sent with every call (the internal token and the tenant of the request being served).

    ``stream``: Verify calls travel on one VerifyStream shared by every session (``coordinator.verify_stream``);
    a verifier without it gets unary Verify calls from its first refusal on, as it does with ``stream`` off.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        target: str,
        timeout_s: float,
        metadata: Callable[[], Metadata] = ANONYMOUS_METADATA,
        stream: bool = True,
    ) -> None:
        self._stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        self._target = target
        self._timeout_s = timeout_s
        self._metadata = metadata
        self._stream: VerifyStreamMux | None = None
        if stream:
            self._stream = VerifyStreamMux(lambda: self._stub.VerifyStream(metadata=self._metadata()), peer_code)

    @property
    def keeps_order(self) -> bool:
        """On the VerifyStream calls go out in the order they are written; unary calls may overtake each other."""
        return self._stream is not None

    def _translate(self, exc: grpc.aio.AioRpcError) -> errors.SpecserveError:
        return self._refusal(exc.code(), exc.details() or "", _draining(exc))

    def _refusal(self, code: grpc.StatusCode, details: str, draining: bool) -> errors.SpecserveError:
        """The domain error for a failed call: a message for clients, the verifier's own words in ``detail``."""
        detail = f"verifier at {self._target}: {code.name}: {details}"
        refusal = _VERIFIER_REFUSALS.get(code)
        if refusal is not None:
            error, message = refusal
            return error(message, detail=detail)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # not a replica failure: no failover
            return errors.DeadlineExceeded(
                "the verifier did not answer within the request's deadline: give the request a longer deadline",
                detail=detail,
            )
        if code == grpc.StatusCode.UNAVAILABLE and draining:
            return ReplicaDraining("a verifier replica is shutting down", detail=detail)
        if code == grpc.StatusCode.UNAVAILABLE:
            return ReplicaUnreachable("a verifier replica is unreachable", detail=detail)
        return errors.Unavailable(f"the verifier failed ({code.name}); retry shortly", detail=detail)

    async def info(self) -> VerifierInfo:
        try:
            r = await self._stub.VerifierInfo(
                verifier_pb2.VerifierInfoRequest(), timeout=self._timeout_s, metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc) from exc
        return VerifierInfo(
            model_name=r.model_name,
            vocab_fingerprint=r.vocab_fingerprint,
            vocab_size=r.vocab_size,
            max_tree_nodes=r.max_tree_nodes,
            max_tree_depth=r.max_tree_depth,
            max_session_tokens=r.max_session_tokens,
            supports_branching=r.supports_branching,
            verify_cost=cost_from_proto(r.verify_cost),
        )

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        with round_phases.protobuf():
            request = prefill_to_proto(call)
        try:
            response = await self._stub.Prefill(
                request, timeout=deadlines.bounded(self._timeout_s), metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc) from exc
        with self._reading():
            return prefill_result_from_proto(response)

    async def verify(self, call: VerifyCall) -> VerifyResult:
        with round_phases.protobuf():
            request = verify_call_to_proto(call)
        if self._stream is not None:
            try:
                r = await self._stream.verify(request, current_tenant().name, deadlines.bounded(self._timeout_s))
            except StreamCallFailed as exc:
                raise self._refusal(exc.code, exc.details, exc.draining) from exc
            except StreamUnsupported:  # never ran there: sent again, as every later call, unary
                log.info("the verifier at %s has no VerifyStream: Verify calls go unary", self._target)
                self._stream.close()
                self._stream = None
                r = await self._unary_verify(request)
        else:
            r = await self._unary_verify(request)
        with self._reading(), round_phases.protobuf():
            return verify_result_from_proto(r, call.num_successors)

    async def _unary_verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        try:
            response: verifier_pb2.VerifyResponse = await self._stub.Verify(
                request, timeout=deadlines.bounded(self._timeout_s), metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc) from exc
        return response

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Reading a response: the only ValueError its conversion raises is for malformed features."""
        try:
            yield
        except ValueError as exc:
            raise errors.Unavailable(
                "the verifier sent a malformed answer", detail=f"verifier at {self._target}: features: {exc}"
            ) from exc

    async def release(self, session_id: str) -> None:
        try:
            request = verifier_pb2.ReleaseRequest(session_id=session_id)
            await self._stub.Release(
                request, timeout=min(self._timeout_s, RELEASE_TIMEOUT_S), metadata=self._metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc) from exc


class GrpcDraftStream:
    """One session's bidirectional Draft stream: write a request, read its answer."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        target: str,
        wants_features: bool,
        takes_verified_trees: bool = False,
        sparse_features: bool = False,
        feature_layers: Sequence[int] = (),
    ) -> None:
        self._call = call
        self._target = target
        self.wants_features = wants_features
        # The drafter pre-drafts from the tree verified; one that does not would refuse the message or ignore it.
        self.takes_verified_trees = takes_verified_trees
        # It says each round whether it wants the round's features (a drafter that drafts from none has nothing to say).
        self.sparse_features = sparse_features and wants_features
        # The target layers its head reads (an EAGLE-3 head's), named in the session's Prefill; empty: the last.
        self.feature_layers = tuple(feature_layers) if wants_features else ()

    async def _write(self, request: drafter_pb2.DraftRequest) -> None:
        try:
            await self._call.write(request)
        except grpc.aio.AioRpcError as exc:  # the call ended with this status
            # A write racing the drafter's refusal can end in gRPC's own INTERNAL ("Failed execute_batch")
            # although the refusal's trailers arrived: those decide, where they did.
            if (exc.code() == grpc.StatusCode.UNAVAILABLE and _draining(exc)) or await self._refused_while_draining():
                raise self._draining_error() from exc
            raise DrafterFailed("connection lost", detail=f"drafter at {self._target}: {exc}") from exc
        except asyncio.InvalidStateError as exc:
            if await self._refused_while_draining():
                raise self._draining_error() from exc
            raise DrafterFailed("connection lost", detail=f"drafter at {self._target}: {exc}") from exc

    async def _refused_while_draining(self) -> bool:
        """Whether the call ended because the drafter is shutting down (a refused new Draft stream)."""
        if not self._call.done():
            return False
        code = await peer_code(self._call)
        trailing = await self._call.trailing_metadata() or ()
        return code == grpc.StatusCode.UNAVAILABLE and any((k, v) in DRAINING_METADATA for k, v in trailing)

    def _draining_error(self) -> DrafterDraining:
        return DrafterDraining(
            "the drafter is shutting down", detail=f"drafter at {self._target} refused a new session: draining"
        )

    async def start(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        vocab_size: int = 0,
        verify_cost: Sequence[tuple[int, float]] = (),
        sampling: SamplingParams = GREEDY,
    ) -> None:
        start = drafter_pb2.StartSession(
            session_id=session_id,
            prompt_token_ids=prompt_tokens,
            vocab_fingerprint=vocab_fingerprint,
            vocab_size=vocab_size,
            pool_namespace=current_tenant().pool_namespace,
            verify_cost=cost_to_proto(dict(verify_cost)),
            sampling=sampling_to_proto(sampling),
        )
        await self._write(drafter_pb2.DraftRequest(start=start))

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        last_features = await self._send_features_ahead(feedback.features)
        with round_phases.protobuf():
            request = drafter_pb2.DraftRequest(propose=feedback_to_proto(feedback, max_nodes, last_features))
        await self._write(request)
        response = await self._read()
        with round_phases.protobuf():
            return draft_reply_from_proto(response)

    async def _read(self) -> drafter_pb2.DraftResponse:
        """The drafter's next answer; DrafterFailed (DrafterDraining) when the call ended instead."""
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and _draining(exc):
                raise self._draining_error() from exc
            raise DrafterFailed(
                f"failed ({exc.code().name})", detail=f"drafter at {self._target}: {exc.code().name}: {exc.details()}"
            ) from exc
        if response is grpc.aio.EOF:
            raise DrafterFailed("closed the session stream", detail=f"drafter at {self._target} closed the stream")
        return response

    async def _send_features_ahead(self, features: np.ndarray | None) -> np.ndarray | None:
        """Write all but the last slice of ``features`` as FeatureChunk requests; the last is the propose's.

        The stream keeps its messages in order, so the drafter has every chunk before the propose they belong to.
        """
        if features is None:
            return None
        *ahead, last = split_features(features, FEATURE_CHUNK_BYTES) or [features]
        for chunk in ahead:
            await self._write(
                drafter_pb2.DraftRequest(features=drafter_pb2.FeatureChunk(features=features_to_proto(chunk)))
            )
        return last

    async def verifying(self, verified: VerifiedTree) -> None:
        if self.takes_verified_trees:
            await self._write(drafter_pb2.DraftRequest(verified=verified_tree_to_proto(verified)))

    async def close(self) -> None:
        self._call.cancel()


class GrpcDrafter:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        target: str,
        vocab_size: int = 0,
        metadata: Callable[[], Metadata] = ANONYMOUS_METADATA,
        verify_cost: Sequence[tuple[int, float]] = (),
    ) -> None:
        self._stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        self._channel = channel
        self._metadata = metadata
        self._target = target
        self._vocab_size = vocab_size  # the target's, sent with each session: the drafter drops ids outside it
        self._verify_cost = tuple(verify_cost)  # the verifier's measured curve, sent with each session
        self._info: drafter_pb2.DrafterInfoResponse | None = None  # learnt from DrafterInfo on the first open

    async def info(self, wait_s: float = 0.0) -> drafter_pb2.DrafterInfoResponse:
        """The drafter's DrafterInfo; ``wait_s`` > 0: waits up to that long for it to be reachable at all."""
        return await self._stub.DrafterInfo(
            drafter_pb2.DrafterInfoRequest(),
            timeout=max(5.0, wait_s),
            metadata=self._metadata(),
            wait_for_ready=True if wait_s > 0 else None,
        )

    async def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        sampling: SamplingParams = GREEDY,
    ) -> GrpcDraftStream:
        if self._info is None:
            try:
                self._info = await self.info()
            except grpc.aio.AioRpcError as exc:
                raise DrafterFailed(
                    f"unreachable ({exc.code().name})",
                    detail=f"drafter at {self._target}: {exc.code().name}: {exc.details()}",
                ) from exc
        stream = GrpcDraftStream(
            self._stub.Draft(metadata=self._metadata()),
            self._target,
            self._info.wants_features,
            self._info.takes_verified_trees,
            self._info.sparse_features,
            tuple(self._info.feature_layers),
        )
        await stream.start(session_id, prompt_tokens, vocab_fingerprint, self._vocab_size, self._verify_cost, sampling)
        return stream

    async def aclose(self) -> None:
        """Close the channel (a drafter endpoint that left a watched set, once its streams have ended)."""
        await self._channel.close()
