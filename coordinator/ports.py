"""What the round loop needs from a verifier and a drafter.

The gRPC clients (``grpc_clients``) and the in-process adapters (``bench.inproc``)
both implement these, so the round loop is the same code in a deployment and
in a single-process benchmark.

Errors: a verifier raises specserve.errors.NotFound or FailedPrecondition when
the session must be prefilled again, Unavailable when it cannot be reached
(ReplicaUnreachable when the connection itself failed; SessionMoved when a
router moved the session to another replica, where it must be prefilled
again), DeadlineExceeded when the request's deadline passed; a draft stream
raises DrafterFailed for anything that makes it unusable (all in specserve.errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.sampling import GREEDY, SamplingParams
from specserve.verify_call import SessionPrefill, VerifyCall


@dataclass(frozen=True)
class VerifierInfo:
    model_name: str
    vocab_fingerprint: str
    vocab_size: int
    max_tree_nodes: int
    max_tree_depth: int
    max_session_tokens: int
    supports_branching: bool
    # The verifier's measured cost by draft nodes (empty: not measured); drafters cut trees with it.
    verify_cost: tuple[tuple[int, float], ...] = ()


class VerifierPort(Protocol):
    @property
    def keeps_order(self) -> bool:
        """Whether one session's Verify calls reach the verifier's queue in the order they were started (each
        call's task started before the next one's): the round loop then sends a plain round's Verify before the
        previous round's answer is back (``RoundPolicy.verify_ahead``). Unary gRPC calls may overtake each other."""
        ...

    async def info(self) -> VerifierInfo: ...

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        """Create the session ``call`` names, with the target's features at the cached positions when it asks
        (``specserve.verify_call`` says what each field asks)."""
        ...

    async def verify(self, call: VerifyCall) -> VerifyResult:
        """Verify ``call.tree`` on top of the session (``specserve.verify_call`` says what each field asks)."""
        ...

    async def release(self, session_id: str) -> None: ...


class DraftStream(Protocol):
    # The drafter drafts from the target's features: the round loop asks the verifier for them and forwards them.
    wants_features: bool

    @property
    def sparse_features(self) -> bool:
        """Whether it takes features sparsely: the round loop asks the verifier for a round's only where the reply
        with the round's tree wants them (``DraftReply.wants_features``; a round that asks for no tree, with no
        draft budget, has none), and forwards each report's as the last rows before its newest token. False:
        every position's (older drafters)."""
        ...

    @property
    def takes_verified_trees(self) -> bool:
        """Whether it pre-drafts from the tree verified (``verifying``): a constrained round tells it, else not."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers its draft head reads (an EAGLE-3 head's three), which the round loop names in the
        session's Prefill; empty: the target's final hidden state."""
        ...

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        """Report the last round and get a tree (max_nodes 0: report only)."""
        ...

    async def verifying(self, verified: VerifiedTree) -> None:
        """Tell the drafter the tree verified for its last tree when it is not that tree (structured output:
        pruned to the grammar, forced tokens added), so that it pre-drafts for the outcomes that can happen.
        No answer; called only where ``takes_verified_trees``."""
        ...

    async def close(self) -> None: ...


class DrafterPort(Protocol):
    async def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        sampling: SamplingParams = GREEDY,
    ) -> DraftStream:
        """A draft stream for one session; ``sampling`` (seed included) lets the drafter couple its drafts."""
        ...


class DrafterMonitor(Protocol):
    """Hears of drafter faults that only the round loop sees (a health-checking DrafterPort implements it)."""

    def misbehaved(self, session_id: str, reason: str) -> None:
        """The drafter of ``session_id`` sent what it must not: a malformed tree, or one the verifier rejected."""
        ...
