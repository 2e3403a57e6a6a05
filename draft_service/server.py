"""gRPC edge of the drafter: one bidirectional stream per generation session."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from draft_service.drafter import Drafter, DraftSession
from specserve.draft_feedback import DraftFeedback
from specserve.token_tree import TokenTree
from specserve.v1 import drafter_pb2, drafter_pb2_grpc
from specserve.wire import features_from_proto, tree_to_proto


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter) -> None:
        self._drafter = drafter
        self._num_active_sessions = 0
        self._drafting = threading.Lock()

    def _propose(self, session: DraftSession, feedback: DraftFeedback, max_nodes: int) -> tuple[TokenTree, int]:
        with self._drafting:
            return session.propose(feedback, max_nodes)

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("action") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a Draft stream must be `start`")
        start = first.start
        try:
            session = self._drafter.open_session(
                start.session_id, list(start.prompt_token_ids), start.vocab_fingerprint
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._num_active_sessions += 1
        try:
            async for request in request_iterator:
                if request.WhichOneof("action") != "propose":
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a Draft stream may be `start`"
                    )
                propose = request.propose
                try:
                    features = features_from_proto(propose.features)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"propose.features: {exc}")
                feedback = DraftFeedback(
                    tuple(propose.new_token_ids),
                    tuple((s.token_id, tuple(s.next_token_ids)) for s in propose.successors),
                    features,
                    tuple(propose.accepted_node_indices),
                )
                # Off the event loop, so a draft model's forward does not stall the other sessions' streams;
                # one at a time, because sessions share pools, successor tables and statistics.
                tree, draft_ns = await asyncio.to_thread(self._propose, session, feedback, propose.max_nodes)
                yield drafter_pb2.DraftResponse(tree=tree_to_proto(tree), draft_ns=draft_ns)
        finally:
            # The stream is the session: when it ends, the state goes.
            self._num_active_sessions -= 1

    async def DrafterInfo(
        self, request: drafter_pb2.DrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(
            vocab_fingerprint=self._drafter.vocab_fingerprint,
            sources=self._drafter.sources,
            num_active_sessions=self._num_active_sessions,
            wants_features=self._drafter.wants_features,
        )
