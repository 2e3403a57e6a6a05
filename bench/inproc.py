"""In-process adapters: the round loop over a Verifier and a Drafter in this process.

Used by the single-process benchmark mode and by unit tests; no gRPC involved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from coordinator.ports import VerifierInfo
from draft_service.drafter import Drafter, DraftSession
from draft_service.tree_builder import VerifyCost
from specserve.errors import DrafterFailed
from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.sampling import GREEDY, SamplingParams
from specserve.tenancy import current_tenant
from specserve.verify_call import SessionPrefill, VerifyCall
from target_service.verifier import Verifier


def verifier_info(v: Verifier) -> VerifierInfo:
    return VerifierInfo(
        model_name=v.model_name,
        vocab_fingerprint=v.vocab_fingerprint,
        vocab_size=v.vocab_size,
        max_tree_nodes=v.limits.max_tree_nodes,
        max_tree_depth=v.limits.max_tree_depth,
        max_session_tokens=v.limits.max_session_tokens,
        supports_branching=v.supports_branching,
        verify_cost=tuple(sorted(v.cost_curve.verify_cost().items())),
    )


class InProcessVerifier:
    """The round loop's VerifierPort over a Verifier in this process; waiting never blocks the event loop."""

    keeps_order = True  # each call is queued on the engine as its task starts

    def __init__(self, verifier: Verifier) -> None:
        self._verifier = verifier

    async def info(self) -> VerifierInfo:
        return verifier_info(self._verifier)

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        return await asyncio.wrap_future(
            self._verifier.submit_prefill(
                call.session_id,
                list(call.token_ids),
                call.sampling,
                call.return_features,
                feature_layers=call.feature_layers,
            )
        )

    async def verify(self, call: VerifyCall) -> VerifyResult:
        return await asyncio.wrap_future(
            self._verifier.submit_verify(
                call.session_id,
                call.num_committed,
                call.tree,
                call.num_successors,
                call.return_features,
                token_masks=call.token_masks,
                draft_ns=call.draft_ns,
                lookahead=call.lookahead,
            )
        )

    async def release(self, session_id: str) -> None:
        self._verifier.release(session_id)


class _InProcessDraftStream:
    def __init__(self, session: DraftSession, predraft: bool, feature_layers: tuple[int, ...] = ()) -> None:
        self._session = session
        self._predraft = predraft
        self.wants_features = session.wants_features
        self.feature_layers = feature_layers if session.wants_features else ()
        self.takes_verified_trees = predraft and session.predrafts
        # It says each round whether it wants the round's features, as a drafter's server does.
        self.sparse_features = session.wants_features

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        reply = self._session.propose(feedback, max_nodes)
        while self._session.work_ahead(predraft=self._predraft):  # no idle cores here: it is done at once
            pass
        return reply

    async def verifying(self, verified: VerifiedTree) -> None:
        self._session.verified(verified)
        while self._session.work_ahead(predraft=self._predraft):
            pass

    async def close(self) -> None:
        self._session.close()


class InProcessDrafter:
    """The round loop's DrafterPort over a Drafter in this process.

    ``predraft``: after each answer, draft ahead for the tree's likeliest
    outcomes before returning (the drafter's ``predraft_outcomes`` of them).
    In one process there is no idle core to hide that on, so this serves
    tests of the pre-drafted path, not speed.
    """

    def __init__(
        self,
        drafter: Drafter,
        predraft: bool = False,
        vocab_size: int = 0,
        verify_cost: Sequence[tuple[int, float]] = (),
    ) -> None:
        self._drafter = drafter
        self._predraft = predraft
        self._vocab_size = vocab_size  # the target's (0: unknown): the drafter drops draft tokens outside it
        # The verifier's measured cost by draft nodes (empty: the drafter's own curve).
        self._verify_cost = VerifyCost.from_points(verify_cost) if verify_cost else None

    async def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        sampling: SamplingParams = GREEDY,
    ) -> _InProcessDraftStream:
        try:
            session = self._drafter.open_session(
                session_id,
                prompt_tokens,
                vocab_fingerprint,
                self._vocab_size,
                current_tenant().pool_namespace,
                self._verify_cost,
                sampling,
            )
            return _InProcessDraftStream(session, self._predraft, self._drafter.feature_layers)
        except ValueError as exc:  # the drafter cannot serve this session (a draft head for another vocabulary)
            raise DrafterFailed(str(exc)) from exc
