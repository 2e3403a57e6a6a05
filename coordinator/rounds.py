"""The round loop: propose -> verify -> commit -> record -> stream, in one place.

One Generation serves one request. Each round the drafter proposes a tree for
the committed tokens, the verifier accepts a path of it and adds its bonus
token, and the new tokens are committed and streamed. Reporting the commit to
the drafter (which records it in the n-gram pool) rides on the next round's
proposal request.

Two failure paths keep a request alive and its output unchanged:
- the drafter fails or is too slow: the rest of the request runs with empty
  trees (plain decoding by the verifier), and the stats say why;
- the verifier lost the session (evicted, restarted): it is prefilled again
  from the committed tokens and the same tree is verified again, so no token
  is lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from coordinator.ports import DrafterFailed, DrafterPort, DraftStream, VerifierPort
from coordinator.text import IncrementalDetokenizer, StopMatcher
from specserve.acceptance import VerifyResult
from specserve.draft_feedback import DraftFeedback
from specserve.errors import FailedPrecondition, NotFound, Unavailable
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextChunk:
    text: str
    token_ids: list[int]


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds_without_drafter: int = 0
    num_reprefills: int = 0
    num_rounds_budget_off: int = 0  # rounds where the verifier's load budget left no room for drafts
    total_ns: int = 0
    draft_ns: int = 0
    verify_ns: int = 0
    drafter_error: str = ""
    finish_reason: FinishReason = FinishReason.LENGTH

    @property
    def coordination_ns(self) -> int:
        return max(0, self.total_ns - self.draft_ns - self.verify_ns)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (acceptance length)."""
        return self.num_generated_tokens / self.num_rounds if self.num_rounds else 0.0


@dataclass(frozen=True)
class RoundPolicy:
    draft_max_nodes: int = 16
    draft_timeout_s: float = 1.0
    max_session_tokens: int = 8192
    successors_top_k: int = 4  # target top tokens per scored position sent back to the drafter (0: off)
    max_reprefills_per_round: int = 4


@dataclass
class Generation:
    """One request's state; ``stream()`` runs it and yields TextChunks, then the stats."""

    request: GenerationRequest
    verifier: VerifierPort
    drafter: DrafterPort | None
    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_fingerprint: str
    policy: RoundPolicy = RoundPolicy()
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        self._committed = list(self.request.prompt_ids)
        self._draft: DraftStream | None = None
        self._unreported: list[int] = []  # committed tokens the drafter has not been told about
        self._successors: list[tuple[int, tuple[int, ...]]] = []  # last round's target top tokens
        self._unreported_features: list[np.ndarray] = []  # target features the drafter has not had
        self._draft_budget: int | None = None  # the verifier's last word on how many nodes pay at its load
        self.stats.num_prompt_tokens = len(self.request.prompt_ids)

    async def stream(self) -> AsyncIterator[TextChunk | GenerationStats]:
        start = time.perf_counter_ns()
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.request.prompt_ids)
        stop = StopMatcher(self.request.stop)
        try:
            await self._open_drafter()
            prefill = await self.verifier.prefill(
                self.session_id, self._committed, self.request.sampling, self._wants_features
            )
            self.stats.verify_ns += prefill.prefill_ns
            self._keep_features(prefill.features, len(self._committed) - 1)
            generated = 0
            while True:
                new_tokens = await self._round(self.request.max_new_tokens - generated)
                chunk_ids: list[int] = []
                text = ""
                for token in new_tokens:
                    if token in self.eos_token_ids:
                        self.stats.finish_reason = FinishReason.EOS
                        break
                    chunk_ids.append(token)
                    text += stop.feed(detokenizer.push(token))
                    if stop.stopped:
                        self.stats.finish_reason = FinishReason.STOP
                        break
                generated += len(new_tokens)
                self.stats.num_generated_tokens += len(chunk_ids)
                finished = stop.stopped or self.stats.finish_reason is FinishReason.EOS
                finished = finished or generated >= self.request.max_new_tokens
                if finished and not stop.stopped:
                    text += stop.feed(detokenizer.flush()) + stop.flush()
                if text or chunk_ids:
                    yield TextChunk(text, chunk_ids)
                if finished:
                    break
            await self._report_final()
        finally:
            await self._close()
            self.stats.total_ns = time.perf_counter_ns() - start
        yield self.stats

    async def _round(self, remaining: int) -> list[int]:
        """One propose -> verify -> commit; returns the committed tokens (at most ``remaining``)."""
        room = self.policy.max_session_tokens - len(self._committed) - 1
        max_nodes = max(0, min(self.policy.draft_max_nodes, remaining - 1, room))
        if self._draft_budget is not None and self._draft_budget < max_nodes:
            max_nodes = self._draft_budget
            self.stats.num_rounds_budget_off += max_nodes == 0
        tree = await self._propose(max_nodes)
        pending = self._committed[-1]
        result = await self._verify(tree)
        self._draft_budget = result.draft_budget_nodes
        if result.top_tokens and self._draft is not None:
            positions = (pending, *tree.token_ids)
            self._successors = [(t, tuple(top)) for t, top in zip(positions, result.top_tokens, strict=True)]
        self.stats.num_rounds += 1
        self.stats.num_draft_tokens += len(tree)
        self.stats.num_accepted_tokens += len(result.accepted_tokens)
        new_tokens = result.committed[:remaining]
        self._committed.extend(new_tokens)
        self._unreported.extend(new_tokens)
        # Row i is the feature at the position before new token i: one row per new token.
        self._keep_features(result.features, len(new_tokens))
        return new_tokens

    async def _open_drafter(self) -> None:
        if self.drafter is None:
            self.stats.drafter_error = "no drafter configured"
            return
        started = time.perf_counter_ns()
        try:
            self._draft = await asyncio.wait_for(
                self.drafter.open(self.session_id, self.request.prompt_ids, self.vocab_fingerprint),
                self.policy.draft_timeout_s,
            )
        except (DrafterFailed, TimeoutError) as exc:
            self._drop_drafter(exc)
        finally:
            self.stats.draft_ns += time.perf_counter_ns() - started

    async def _propose(self, max_nodes: int) -> TokenTree:
        if max_nodes == 0 and self._draft is not None:
            # Nothing to draft this round: the commit report waits for the next request (or the final one).
            return TokenTree()
        tree = await self._ask_drafter(max_nodes) if self._draft is not None else None
        if tree is None:
            self.stats.num_rounds_without_drafter += 1
            return TokenTree()
        return tree

    async def _ask_drafter(self, max_nodes: int) -> TokenTree | None:
        """Send the last round's report and get a tree; None (and the drafter dropped) on failure."""
        assert self._draft is not None
        started = time.perf_counter_ns()
        try:
            proposal = self._draft.propose(self._feedback(), max_nodes)
            tree, _ = await asyncio.wait_for(proposal, self.policy.draft_timeout_s)
            return tree
        except (DrafterFailed, TimeoutError) as exc:
            self._drop_drafter(exc)
            return None
        finally:
            self.stats.draft_ns += time.perf_counter_ns() - started

    @property
    def _wants_features(self) -> bool:
        return self._draft is not None and self._draft.wants_features

    def _keep_features(self, features: np.ndarray | None, rows: int) -> None:
        """Queue the target's features for the drafter; it must get exactly ``rows`` of them."""
        if not self._wants_features:
            return
        if features is None or features.shape[0] < rows:
            # The drafter's model cannot follow without them; the request goes on without the drafter.
            got = "no" if features is None else features.shape[0]
            self._drop_drafter(DrafterFailed(f"the verifier returned {got} feature rows where {rows} were expected"))
            return
        self._unreported_features.append(features[:rows])

    def _feedback(self) -> DraftFeedback:
        """The last round's report for the drafter; taking it marks it as sent."""
        features = np.concatenate(self._unreported_features) if self._unreported_features else None
        feedback = DraftFeedback(tuple(self._unreported), tuple(self._successors), features)
        self._unreported, self._successors, self._unreported_features = [], [], []
        return feedback

    async def _verify(self, tree: TokenTree) -> VerifyResult:
        top_k = self.policy.successors_top_k if self._draft is not None else 0
        for _ in range(self.policy.max_reprefills_per_round):
            try:
                result = await self.verifier.verify(
                    self.session_id, len(self._committed), tree, top_k, self._wants_features
                )
                self.stats.verify_ns += result.verify_ns
                return result
            except (NotFound, FailedPrecondition):
                # The verifier lost the session: rebuild it from what was committed, verify the same tree again.
                self.stats.num_reprefills += 1
                # The drafter already has the features of these positions: none are asked for.
                prefill = await self.verifier.prefill(self.session_id, self._committed, self.request.sampling)
                self.stats.verify_ns += prefill.prefill_ns
        raise Unavailable(
            f"the verifier lost this request's session {self.policy.max_reprefills_per_round} times in one round; "
            "it is evicting sessions faster than they are used: raise its --max-sessions"
        )

    async def _report_final(self) -> None:
        """Tell the drafter the last round's tokens so the n-gram pool learns all of them."""
        if self._draft is not None and self._unreported:
            await self._ask_drafter(0)

    def _drop_drafter(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {self.policy.draft_timeout_s * 1000:.0f} ms"
        else:
            reason = str(exc) or type(exc).__name__
        self.stats.drafter_error = f"drafter dropped: {reason}"
        draft, self._draft = self._draft, None
        if draft is not None:
            asyncio.get_running_loop().create_task(draft.close())

    async def _close(self) -> None:
        if self._draft is not None:
            await self._draft.close()
        with contextlib.suppress(Unavailable):  # the verifier's TTL frees the session
            await self.verifier.release(self.session_id)
