"""gRPC edge of the drafter: one bidirectional stream per generation session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from draft_service.drafter import Drafter
from specserve.draft_feedback import DraftFeedback
from specserve.v1 import drafter_pb2, drafter_pb2_grpc
from specserve.wire import tree_to_proto


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter) -> None:
        self._drafter = drafter
        self._num_active_sessions = 0

    async def Draft(
        self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("action") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a Draft stream must be `start`")
        start = first.start
        session = self._drafter.open_session(start.session_id, list(start.prompt_token_ids), start.vocab_fingerprint)
        self._num_active_sessions += 1
        try:
            async for request in request_iterator:
                if request.WhichOneof("action") != "propose":
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a Draft stream may be `start`"
                    )
                propose = request.propose
                feedback = DraftFeedback(
                    tuple(propose.new_token_ids),
                    tuple((s.token_id, tuple(s.next_token_ids)) for s in propose.successors),
                )
                tree, draft_ns = session.propose(feedback, propose.max_nodes)
                yield drafter_pb2.DraftResponse(tree=tree_to_proto(tree), draft_ns=draft_ns)
        finally:
            # The stream is the session: when it ends, the state goes.
            self._num_active_sessions -= 1

    async def DrafterInfo(
        self, request: drafter_pb2.DrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(
            vocab_fingerprint="",
            sources=self._drafter.sources,
            num_active_sessions=self._num_active_sessions,
        )
