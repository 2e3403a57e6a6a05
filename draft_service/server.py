"""gRPC edge of the drafter: one bidirectional stream per generation session."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import grpc
import numpy as np

from draft_service.drafter import Drafter, DraftSession
from draft_service.pools import PoolRegistry
from draft_service.tree_builder import VerifyCost
from draft_service.work_ahead import WorkAhead
from specserve import errors
from specserve.drain import Drain
from specserve.results import DraftFeedback, DraftReply
from specserve.rpc import refused_while_draining
from specserve.v1 import drafter_pb2, drafter_pb2_grpc
from specserve.wire import (
    cost_from_proto,
    draft_reply_to_proto,
    features_from_proto,
    feedback_from_proto,
    sampling_from_proto,
    verified_tree_from_proto,
)

_log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_FEATURE_BYTES_AHEAD = 128 << 20
"""Most FeatureChunk bytes one stream may send ahead of a propose (beyond it: RESOURCE_EXHAUSTED).

The features of 16,384 positions of a 4,096-wide target; a whole 8,192-token SmolLM2 context needs 9 MiB.
"""


class FeaturesAhead:
    """The FeatureChunk rows a stream sent ahead of its next propose, in order."""

    def __init__(self, max_bytes: int = MAX_FEATURE_BYTES_AHEAD) -> None:
        self._chunks: list[np.ndarray] = []
        self._bytes = 0
        self._max_bytes = max_bytes

    def add(self, chunk: drafter_pb2.FeatureChunk) -> None:
        """Keep a chunk's rows; InvalidArgument when malformed, ResourceExhausted past the bound."""
        try:
            rows = features_from_proto(chunk.features)
        except ValueError as exc:
            raise errors.InvalidArgument(f"features: {exc}") from exc
        if rows is None:
            raise errors.InvalidArgument("features: a FeatureChunk must carry features (hidden_size > 0)")
        self._check_width(rows, "features")
        self._bytes += rows.nbytes
        if self._bytes > self._max_bytes:
            raise errors.ResourceExhausted(
                f"features: {self._bytes} bytes sent ahead of a propose, more than the {self._max_bytes} allowed"
            )
        self._chunks.append(rows)

    def take(self, own: np.ndarray | None) -> np.ndarray | None:
        """The chunks' rows followed by the propose's ``own``, and forget the chunks."""
        if not self._chunks:
            return own
        if own is not None:
            self._check_width(own, "propose.features")
        rows = np.concatenate(self._chunks if own is None else [*self._chunks, own])
        self._chunks, self._bytes = [], 0
        return rows

    def _check_width(self, rows: np.ndarray, field: str) -> None:
        if self._chunks and rows.shape[1] != self._chunks[0].shape[1]:
            raise errors.InvalidArgument(
                f"{field}: hidden size {rows.shape[1]}, but the chunks before it have {self._chunks[0].shape[1]}"
            )


def _check_forced_prefix(prefix: tuple[int, ...], max_nodes: int, vocab_size: int) -> None:
    """INVALID_ARGUMENT for a forced prefix the tree cannot hold or with ids outside the session's vocabulary."""
    if len(prefix) > max(0, max_nodes):
        raise errors.InvalidArgument(
            f"propose.forced_prefix: {len(prefix)} tokens, more than the {max_nodes} nodes the tree may have"
        )
    limit = vocab_size or 2**31
    bad = next((token for token in prefix if not 0 <= token < limit), None)
    if bad is not None:
        raise errors.InvalidArgument(f"propose.forced_prefix: token id {bad} outside the vocabulary [0, {limit})")


DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0


IdleTimer = Callable[[float], AbstractAsyncContextManager[object]]
"""Bounds one wait for the next message: raises TimeoutError in its body when the time is up (``asyncio.timeout``)."""


async def idle_limited(
    requests: AsyncIterator[T], idle_timeout_s: float, timer: IdleTimer = asyncio.timeout
) -> AsyncIterator[T]:
    """``requests`` as they come; a stream silent for ``idle_timeout_s`` is ended with DEADLINE_EXCEEDED.

    A coordinator that died without closing its streams would otherwise keep their sessions' state forever.
    The error is raised, not ``context.abort``-ed here: the handler's ``finally`` frees the session first,
    and the error interceptor sends the status after it, so a client that sees the status sees the state gone.
    """
    iterator = aiter(requests)
    while True:
        try:
            async with timer(idle_timeout_s):
                request = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"no message on this Draft stream for {idle_timeout_s:g} s (--stream-idle-timeout-s): closed "
                "and its session's state freed; open a new stream to draft again"
            ) from None
        yield request


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(
        self,
        drafter: Drafter,
        pools: PoolRegistry | None = None,
        drain: Drain | None = None,
        stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
        idle_timer: IdleTimer = asyncio.timeout,
        work_ahead: WorkAhead | None = None,
    ) -> None:
        self._drafter = drafter
        # Work ahead on its own thread: proposals (and opens) run on asyncio's default executor.
        self.work_ahead = work_ahead or WorkAhead()
        self._pools = pools
        self._idle_timeout_s = stream_idle_timeout_s
        self._idle_timer = idle_timer
        self.drain = drain or Drain()  # on SIGTERM: new Draft streams refused, open ones go on to the end
        self._num_active_sessions = 0
        self._drafting = threading.Lock()
        self._num_waiting = 0  # proposals waiting for the drafting lock: pre-drafting yields to them
        self._waiting_lock = threading.Lock()
        # Told each proposal's seconds in Draft, from its message to its answer (metrics; None: not observed).
        self.observe_propose: Callable[[float], None] | None = None

    def _locked(self, call: Callable[[], T]) -> T:
        """``call`` under the drafting lock, ahead of any work ahead (counted as waiting while it waits)."""
        with self._waiting_lock:
            self._num_waiting += 1
        with self._drafting:
            with self._waiting_lock:
                self._num_waiting -= 1
            return call()

    def _propose(self, session: DraftSession, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        return self._locked(lambda: session.propose(feedback, max_nodes))

    def close(self) -> None:
        """The server stopped: drop work ahead still queued."""
        self.work_ahead.close()

    def _work_ahead(self, session: DraftSession, stop: threading.Event) -> None:
        """Work for ``session``'s next round (digest a long prompt, pre-draft) step by step until told to stop.

        Between steps the lock is let go, and no step starts while any
        session's proposal waits: working ahead only ever uses idle time.
        """
        try:
            while not stop.is_set() and not self._num_waiting:
                with self._drafting:
                    if stop.is_set() or self._num_waiting or not session.work_ahead():
                        return
        except Exception:  # drafting ahead is an optimisation: a failure costs the hit, never the session
            _log.exception("working ahead failed for session %s; it drafts on demand", session.session_id)

    @refused_while_draining("new Draft streams")
    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        request_iterator = idle_limited(request_iterator, self._idle_timeout_s, self._idle_timer)
        first = await anext(request_iterator, None)
        if first is None:
            return
        if first.WhichOneof("action") != "start":
            raise errors.InvalidArgument("the first message of a Draft stream must be `start`")
        start = first.start
        try:
            verify_cost = VerifyCost.from_points(cost_from_proto(start.verify_cost)) if start.verify_cost else None
        except ValueError as exc:
            raise errors.InvalidArgument(f"start.verify_cost: {exc}") from exc
        sampling = sampling_from_proto(start.sampling)
        try:
            sampling.validate()
        except ValueError as exc:
            raise errors.InvalidArgument(f"start.sampling: {exc}") from exc
        try:
            # Under the drafting lock: opening may drop another namespace's pool and table (--max-namespaces).
            session = await asyncio.to_thread(
                self._locked,
                lambda: self._drafter.open_session(
                    start.session_id,
                    list(start.prompt_token_ids),
                    start.vocab_fingerprint,
                    start.vocab_size,
                    start.pool_namespace,
                    verify_cost,
                    sampling,
                ),
            )
        except ValueError as exc:
            raise errors.FailedPrecondition(str(exc)) from exc
        self._num_active_sessions += 1
        ahead = FeaturesAhead()
        work: Future[None] | None = None  # working ahead (pre-drafting) while the coordinator verifies
        stop_ahead = threading.Event()
        try:
            async for request in request_iterator:
                if request.WhichOneof("action") == "features":
                    # Part of the next propose's features: kept, not answered.
                    ahead.add(request.features)
                    continue
                if request.WhichOneof("action") == "verified":
                    # The tree verified for the last propose (structured output): pre-draft for its outcomes.
                    try:
                        verified = verified_tree_from_proto(request.verified, start.vocab_size)
                    except ValueError as exc:
                        raise errors.InvalidArgument(f"verified: {exc}") from exc
                    if work is not None:  # what it started from the session's own tree is of no use now
                        await self.work_ahead.stop(work, stop_ahead)
                    # On the event loop: cheap, and it touches only what this stream's own calls touch.
                    session.verified(verified)
                    stop_ahead = threading.Event()
                    work = self.work_ahead.submit(functools.partial(self._work_ahead, session, stop_ahead))
                    continue
                if request.WhichOneof("action") != "propose":
                    raise errors.InvalidArgument("only the first message of a Draft stream may be `start`")
                propose = request.propose
                received = time.perf_counter()
                try:
                    features = ahead.take(features_from_proto(propose.features))
                except ValueError as exc:
                    raise errors.InvalidArgument(f"propose.features: {exc}") from exc
                feedback = feedback_from_proto(propose, features)
                _check_forced_prefix(feedback.forced_prefix, propose.max_nodes, start.vocab_size)
                if work is not None:  # the report is here: drop the work if queued, else finish its step in hand
                    if await self.work_ahead.stop(work, stop_ahead):
                        self._drafter.predraft_counts.dropped += 1
                    work = None
                # Off the event loop, so a draft model's forward does not stall the other sessions' streams;
                # one at a time, because sessions share pools, successor tables and statistics.
                reply = await asyncio.to_thread(self._propose, session, feedback, propose.max_nodes)
                answer = draft_reply_to_proto(reply)
                if self.observe_propose is not None:
                    self.observe_propose(time.perf_counter() - received)
                yield answer
                stop_ahead = threading.Event()
                work = self.work_ahead.submit(functools.partial(self._work_ahead, session, stop_ahead))
        finally:
            # The stream is the session: when it ends, the state goes (a pre-draft in hand stops after its outcome).
            stop_ahead.set()
            if work is not None:
                work.cancel()
            session.close()
            self._num_active_sessions -= 1

    async def DrafterInfo(
        self, request: drafter_pb2.DrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(
            vocab_fingerprint=self._drafter.vocab_fingerprint,
            sources=self._drafter.sources,
            num_active_sessions=self._num_active_sessions,
            wants_features=self._drafter.wants_features,
            # Only a drafter that pre-drafts uses the tree verified; the others are spared a message a round.
            takes_verified_trees=self._drafter.predraft_outcomes > 0,
            # Its sessions say each round whether they want its features, and the draft head restarts after a gap.
            sparse_features=True,
            feature_layers=self._drafter.feature_layers,  # an EAGLE-3 head's layers (empty: the final state)
        )

    async def PurgePool(
        self, request: drafter_pb2.PurgePoolRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.PurgePoolResponse:
        namespace = request.pool_namespace
        if not namespace:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "pool_namespace is required: 'tenant:<name>' or 'shared'"
            )

        def purge_memory() -> tuple[int, int, int]:
            with self._drafting:  # sessions draft from these pools and tables under this lock
                counts = self._pools.purge_memory(namespace) if self._pools is not None else None
                tables = self._drafter.forget_successors(namespace)
            return (counts.memory_pools if counts else 0), (counts.memory_keys if counts else 0), tables

        pools, keys, tables = await asyncio.to_thread(purge_memory)
        redis_keys = await asyncio.to_thread(self._pools.purge_shared, namespace) if self._pools is not None else 0
        _log.info("purged pool namespace %s: %d in-memory keys, %d Redis keys", namespace, keys, redis_keys)
        return drafter_pb2.PurgePoolResponse(
            memory_pools=pools, memory_keys=keys, redis_keys=redis_keys, successor_tables=tables
        )
