"""The round loop: propose -> verify -> commit -> record -> stream, in one place.

One Generation serves one request. Each round the drafter proposes a tree for
the committed tokens, the verifier accepts a path of it and adds its bonus
token, and the new tokens are committed and streamed. Reporting the commit to
the drafter (which records it in the n-gram pool) rides on the next round's
proposal request.

The commit is cut here and only here (``_commit``): at the request's length,
after an EOS token, after the token that completes a stop string. Tokens the
verifier produced past the cut are never committed, so they never reach the
client, the drafter or the shared pool.

Two failure paths keep a request alive and its output unchanged:
- the drafter fails or is too slow: the rest of the request runs with empty
  trees (plain decoding by the verifier), and the stats say why;
- the verifier lost the session (evicted, restarted, or its replica died and
  the router moved the session to another): it is prefilled again from the
  committed tokens and the same tree is verified again, so no token is lost
  or repeated.

A plain round whose next round is to be plain too (certainly, or because the
verifier's budget left none) sends that round's Verify before its own answer is
back (``_send_ahead``): the verifier steps the session again as soon as it can,
and the hop, the commit and the streaming overlap its work. The answer is
committed by the next round, in order, as its own would be; a round that fails
or a request that ends withdraws it.

The client's deadline (``coordinator.deadlines``) bounds every call: drafter
round trips and verifier calls wait no longer than the time left, and once it
has passed the request ends with DEADLINE_EXCEEDED (its session released).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from coordinator import deadlines
from coordinator.constraints.compiler import CompiledGrammar
from coordinator.constraints.grammar_state import FittedTree, GrammarState
from coordinator.drafting_gate import DraftingGate
from coordinator.ports import DrafterMonitor, DrafterPort, DraftStream, VerifierPort
from coordinator.round_phases import RoundPhases, phase_totals
from coordinator.speculation import Speculation, SpeculationMode
from coordinator.text import IncrementalDetokenizer, StopMatcher
from coordinator.tree_checks import TreeLimits, tree_problem
from specserve.errors import (
    DeadlineExceeded,
    DrafterFailed,
    DrafterSkipped,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SessionMoved,
    Unavailable,
)
from specserve.results import DraftFeedback, DraftReply, VerifiedTree, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree
from specserve.verify_call import SessionPrefill, VerifyCall

MAX_UNREPORTED_NGRAMS = 256
"""Lookahead n-grams kept for the drafter's next report (rounds with no draft budget do not send one)."""

FEW_ALLOWED = 16
"""Where a constraint allows at most this many tokens after a node, the drafter is told which (for its pre-drafts)."""

_CLOSING: set[asyncio.Task[None]] = set()
"""Session closings still running after their request was cancelled: held here so none is collected unfinished."""


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
    speculation: Speculation = Speculation()
    constraint: CompiledGrammar | None = None  # structured output: what the text must match


@dataclass(frozen=True)
class TextChunk:
    text: str
    token_ids: list[int]


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_rounds: int = 0
    num_drafts: int = 0  # rounds whose tree held at least one draft token (vLLM's num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Entry i: rounds whose accepted path reached depth i + 1 (vLLM's num_accepted_tokens_per_pos).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_rounds_without_drafter: int = 0
    num_reprefills: int = 0
    num_rounds_budget_off: int = 0  # rounds where the verifier's load budget left no room for drafts
    num_drafter_trees: int = 0  # rounds whose tree the drafter was asked for and gave
    num_feature_rounds: int = 0  # rounds whose Verify asked for the target's features (for the drafter's head)
    num_predraft_hits: int = 0  # of those, trees the drafter had ready (drafted while the verifier worked)
    predraft_hidden_ns: int = 0  # drafting time of those trees: hidden behind verification
    total_ns: int = 0
    draft_ns: int = 0
    verify_ns: int = 0
    prefill_ns: int = 0  # of verify_ns: prefilling the prompt (re-prefills included)
    num_cached_prompt_tokens: int = 0  # of the prompt, tokens the verifier copied from a kept cache (not prefilled)
    queue_ns: int = 0  # waiting for an admission slot before the stream started (not in total_ns)
    drafter_error: str = ""  # sent to the client: a short cause, no address or peer text
    drafter_error_detail: str = ""  # the whole story (addresses, the peer's words), for the log line only
    finish_reason: FinishReason = FinishReason.LENGTH
    speculation: SpeculationMode = SpeculationMode.AUTO  # what the request ran with
    sampled: bool = False  # the request sampled (temperature > 0); else greedy
    max_draft_tokens: int = 0  # its cap on draft tokens per round: the request's, within the server's (0: off)
    constrained: bool = False  # the request had a constraint (structured output)
    constraint_kind: str = ""  # its kind (a ConstraintKind value: json_schema, regex, lark_grammar, choice)
    num_forced_tokens: int = 0  # accepted draft tokens the constraint alone allowed (certain drafts)
    constraint_complete: bool = False  # with a constraint: the output completed it
    mask_ns: int = 0  # computing the constraint's token masks
    # Entry i: mask time of round i's tree (the metrics' histogram; not sent to the client).
    mask_ns_per_round: list[int] = field(default_factory=list)
    # Entry i: round i's time by phase, in ``round_phases.PHASES`` order (the metrics' histograms).
    round_phase_ns: list[tuple[int, ...]] = field(default_factory=list)
    num_rounds_plain_by_cost: int = 0  # rounds run plain because drafted rounds did not pay end to end (or to time one)
    num_rounds_sent_ahead: int = 0  # rounds whose Verify went before the previous round's answer (``_send_ahead``)
    num_ahead_withdrawn: int = 0  # Verify calls sent ahead and withdrawn: the request ended, or a round failed

    @property
    def drafter_error_logged(self) -> str:
        """Why drafting stopped, in full, for the request's log line (the client gets ``drafter_error``)."""
        return self.drafter_error_detail or self.drafter_error

    @property
    def coordination_ns(self) -> int:
        return max(0, self.total_ns - self.draft_ns - self.verify_ns)

    @property
    def phase_ns(self) -> dict[str, int]:
        """Each phase's time summed over the request's rounds (``coordinator.round_phases``)."""
        return phase_totals(self.round_phase_ns)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (acceptance length)."""
        return self.num_generated_tokens / self.num_rounds if self.num_rounds else 0.0


@dataclass(frozen=True)
class RoundPolicy:
    max_draft_tokens: int = 16  # the server's cap on draft tokens (tree nodes) per round; a request may lower it
    draft_timeout_s: float = 1.0
    max_session_tokens: int = 8192
    num_successors: int = 4  # the target's likeliest next tokens per scored position, for the drafter (0: off)
    max_reprefills_per_round: int = 4
    # What the verifier accepts in a tree: each drafter tree is checked against it first (None: unchecked).
    tree_limits: TreeLimits | None = None
    # Each session drafts only while its drafted rounds commit more tokens per second than its plain ones, end to
    # end (``coordinator.drafting_gate``); the services' ``round_policy`` turns it on. Off: the verifier's budget
    # alone decides.
    gate_drafting: bool = False
    # Where the next round is to be plain, send its Verify before this round's answer is back
    # (``Generation._send_ahead``), on a verifier port that keeps one session's calls in order.
    verify_ahead: bool = True


@dataclass
class _Ahead:
    """The next round's Verify, sent while this round's was on its way (``Generation._send_ahead``)."""

    task: asyncio.Future[VerifyResult]
    asked_features: bool


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
    # Told when the drafter sends a bad tree, so later requests can skip it (the health-checked drafter).
    drafter_monitor: DrafterMonitor | None = None
    clock: Callable[[], int] = time.perf_counter_ns  # times each round's phases (nanoseconds)

    def __post_init__(self) -> None:
        self._committed = list(self.request.prompt_ids)
        # One seed for the whole request, fixed here: the verifier samples with it, the drafter drafts with the
        # same keyed noise (coupled drafts), and a session moved to another verifier replica keeps it.
        self._sampling = self.request.sampling.with_seed()
        self._draft: DraftStream | None = None
        self._unreported: list[int] = []  # committed tokens the drafter has not been told about
        self._successors: list[tuple[int, tuple[int, ...]]] = []  # last round's target top tokens
        self._lookahead_ngrams: tuple[tuple[int, ...], ...] = ()  # the verifier's lookahead n-grams, not yet told
        self._unreported_features: list[np.ndarray] = []  # target features the drafter has not had
        self._features_wanted = False  # this round's tree came with the drafter's wish for the round's features
        self._draft_wait_ns = 0  # this round's wait for the drafter's tree (0: none asked)
        self._draft_budget: int | None = None  # the verifier's last word on how many nodes pay at its load
        self._ahead: _Ahead | None = None  # the next round's Verify, already sent
        self._gate = DraftingGate() if self.policy.gate_drafting else None
        self._phases: RoundPhases | None = None  # the round in progress's phases
        self._asked_drafter = False  # the round in progress asked the drafter for a tree
        self._accepted_nodes: tuple[int, ...] = ()  # the verifier's accepted node indices in the drafter's tree
        self._detokenizer = IncrementalDetokenizer(self.tokenizer, self.request.prompt_ids)
        self._stop = StopMatcher(self.request.stop)
        self._num_new = 0  # tokens committed after the prompt (EOS included)
        self._finished = False
        self.stats.num_prompt_tokens = len(self.request.prompt_ids)
        self.stats.speculation = self.request.speculation.mode
        self.stats.sampled = not self.request.sampling.greedy
        self.stats.max_draft_tokens = self.request.speculation.draft_limit(self.policy.max_draft_tokens)
        constraint = self.request.constraint
        self._grammar: GrammarState | None = constraint.new_state() if constraint is not None else None
        self.stats.constrained = self._grammar is not None
        self.stats.constraint_kind = constraint.constraint.kind.value if constraint is not None else ""

    async def stream(self) -> AsyncGenerator[TextChunk | GenerationStats, None]:
        start = time.perf_counter_ns()
        try:
            await self._open_drafter()
            await self._prefill()
            while not self._finished:
                deadlines.check()
                chunk = await self._round()
                if chunk.text or chunk.token_ids:
                    yield chunk
            self._drop_ahead()  # sent for a round the request no longer has (it ended at EOS or a stop string)
            await self._report_final()
        finally:
            if self._grammar is not None:
                self.stats.constraint_complete = self._grammar.complete
                self.stats.mask_ns = self._grammar.mask_ns
            await self._close()
            self.stats.total_ns = time.perf_counter_ns() - start
        yield self.stats

    def _commit(self, tokens: list[int]) -> TextChunk:
        """Commit the verifier's new tokens up to the first cut; returns what the client sees of them.

        Cuts: the request's length, an EOS token (committed, not shown), the
        token that completes a stop string. Tokens past a cut are dropped.
        """
        kept = tokens[: self.request.max_new_tokens - self._num_new]
        shown: list[int] = []
        text = ""
        for count, token in enumerate(kept, start=1):
            if token in self.eos_token_ids:
                self.stats.finish_reason = FinishReason.EOS
                kept = kept[:count]
                break
            shown.append(token)
            text += self._stop.feed(self._detokenizer.push(token))
            if self._stop.stopped:
                self.stats.finish_reason = FinishReason.STOP
                kept = kept[:count]
                break
        if self._grammar is not None:
            self._grammar.commit([t for t in kept if t not in self.eos_token_ids])
        self._committed.extend(kept)
        self._unreported.extend(kept)
        self._num_new += len(kept)
        self.stats.num_generated_tokens += len(shown)
        self._finished = self.stats.finish_reason is not FinishReason.LENGTH
        self._finished = self._finished or self._num_new >= self.request.max_new_tokens
        if self._finished and not self._stop.stopped:
            text += self._stop.feed(self._detokenizer.flush()) + self._stop.flush()
        return TextChunk(text, shown)

    async def _round(self) -> TextChunk:
        """One propose -> verify -> commit, its phases timed; returns the new text for the client."""
        phases = self._phases = RoundPhases(self.clock)
        self._asked_drafter = False
        before = len(self._committed)
        chunk = await self._propose_verify_commit(phases)
        self.stats.round_phase_ns.append(times := phases.end())
        self._phases = None
        if self._gate is not None:
            self._gate.observe(self._asked_drafter, len(self._committed) - before, sum(times) / 1e9)
        return chunk

    def _gated(self, max_nodes: int) -> int:
        """``max_nodes``, or 0 where this session's drafted rounds do not pay end to end (``drafting_gate``)."""
        if self._gate is None or max_nodes == 0 or self._draft is None or self._gate.drafts():
            return max_nodes
        self.stats.num_rounds_plain_by_cost += 1
        return 0

    async def _propose_verify_commit(self, phases: RoundPhases) -> TextChunk:
        remaining = self.request.max_new_tokens - self._num_new
        room = self.policy.max_session_tokens - len(self._committed) - 1
        max_nodes = max(0, min(self.stats.max_draft_tokens, remaining - 1, room))
        if self._draft_budget is not None and self._draft_budget < max_nodes:
            max_nodes = self._draft_budget
            self.stats.num_rounds_budget_off += max_nodes == 0
        max_nodes = self._gated(max_nodes)
        if self._ahead is not None:
            max_nodes = 0  # this round's plain Verify is already on its way (``_send_ahead``)
        with phases.span("tree_and_masks"):
            prefix = self._forced_prefix(max_nodes, remaining, room)
        if prefix:  # the drafter drafts after what the constraint forces next; its tree starts with it
            max_nodes = min(len(prefix) + max_nodes, self._tree_caps(remaining, room)[0])
        self._draft_wait_ns = 0
        self._features_wanted = False  # a round that asks the drafter for no tree wants no features
        tree, drafted = await self._propose(max_nodes, prefix)
        with phases.span("tree_and_masks"):
            fitted = self._fit(tree, remaining, room)
        pending = self._committed[-1]
        # A drafter that pre-drafts hears of the fitted tree while the verifier works (before the next proposal).
        telling = None
        if fitted is not None and drafted and self._draft is not None and self._draft.takes_verified_trees:
            telling = asyncio.ensure_future(self._tell_verified(fitted))
        try:
            result, tree = await self._verify(tree if fitted is None else fitted.tree, fitted)
        except BaseException:
            if telling is not None:  # the round failed: its outcome, whatever it is, is of no use now
                telling.cancel()
                telling.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise
        if telling is not None:
            await telling
        if fitted is not None and len(tree) != len(fitted.tree):
            fitted = None  # the verifier refused the tree: the round ran with none
        drafted = drafted and bool(tree.token_ids)
        self._draft_budget = result.draft_budget_nodes
        if result.lookahead_ngrams and self._draft is not None:  # the newest, while rounds ask for no tree
            self._lookahead_ngrams = (*self._lookahead_ngrams, *result.lookahead_ngrams)[-MAX_UNREPORTED_NGRAMS:]
        if result.successors and self._draft is not None:
            positions = (pending, *tree.token_ids)
            self._successors = [(t, tuple(top)) for t, top in zip(positions, result.successors, strict=True)]
        if drafted:  # the drafter learns which of its nodes were taken, in its own tree's indices
            nodes = result.accepted_nodes
            self._accepted_nodes = tuple(nodes) if fitted is None else fitted.drafter_path(nodes)
        if fitted is not None:
            self.stats.num_forced_tokens += sum(fitted.forced[node] for node in result.accepted_nodes)
        self._count_round(len(tree), len(result.accepted_tokens))
        before = len(self._committed)
        chunk = self._commit(result.committed)
        # Row i is the feature at the position before new token i: one row per committed token.
        self._keep_features(result.features, len(self._committed) - before, self._asks_features())
        return chunk

    def _tree_caps(self, remaining: int, room: int) -> tuple[int, int]:
        """The most nodes, and the deepest depth, of a constrained round's tree. Forced tokens are certain, so
        they go in whatever the load budget says, within the verifier's limits; with speculation off there are
        none (plain decoding)."""
        limits = self.policy.tree_limits
        cap = max(0, min(remaining - 1, room, limits.max_nodes if limits else self.policy.max_draft_tokens))
        if self.request.speculation.mode is SpeculationMode.OFF:
            cap = 0
        return cap, (limits.max_depth if limits and limits.max_depth else cap) or cap

    def _forced_prefix(self, budget: int, remaining: int, room: int) -> tuple[int, ...]:
        """What the constraint forces right after the committed tokens, for the drafter to draft after (empty
        without a constraint, a drafter or a draft budget; with speculation off the caps are 0). Left at least
        one node and one level of the tree, for a drafted token."""
        if self._grammar is None or self._draft is None or budget <= 0:
            return ()
        cap, depth = self._tree_caps(remaining, room)
        return self._grammar.forced_next(min(cap, depth) - 1)

    def _fit(self, tree: TokenTree, remaining: int, room: int) -> FittedTree | None:
        """With a constraint: the drafter's tree pruned to what the grammar allows, forced tokens added, and
        each row's mask (None without a constraint)."""
        if self._grammar is None:
            return None
        cap, depth = self._tree_caps(remaining, room)
        before = self._grammar.mask_ns
        fitted = self._grammar.fit(tree, cap, depth)
        self.stats.mask_ns_per_round.append(self._grammar.mask_ns - before)
        return fitted

    async def _tell_verified(self, fitted: FittedTree) -> None:
        """Tell the drafter the tree about to be verified: its own, fitted to the constraint.

        The drafter pre-drafts the next round while the verifier works, keyed by the path it expects accepted
        and a guess at the bonus token after it; most paths under a constraint end in forced tokens it never
        drafted. Told the fitted tree, it keys its pre-drafts by paths that can happen, and where the grammar
        allows few tokens next it guesses the bonus among those. Nothing verified changes; a failure here drops
        the drafter. Runs beside the Verify call.
        """
        draft = self._draft
        if draft is None or self._grammar is None:
            return
        # Not counted in draft_ns: it runs while the verifier works, off the round's critical path.
        few = self._grammar.few_allowed(fitted, FEW_ALLOWED)
        try:
            async with asyncio.timeout(deadlines.bounded(self.policy.draft_timeout_s)):
                await draft.verifying(VerifiedTree(fitted.tree, fitted.forced, few))
        except (DrafterFailed, TimeoutError) as exc:
            deadlines.check()  # the request's deadline passed, not the drafter's
            if self._draft is draft:  # else the round already dropped it, for a cause worth keeping
                self._drop_drafter(exc)

    def _count_round(self, num_draft: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_rounds += 1
        stats.num_drafts += num_draft > 0
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_accepted - len(per_pos)))
        for depth in range(num_accepted):
            per_pos[depth] += 1

    async def _open_drafter(self) -> None:
        if self.request.speculation.mode is SpeculationMode.OFF:
            return  # the caller asked for plain decoding: no drafter, no draft stream, no drafting cost
        if self.drafter is None:
            self.stats.drafter_error = "no drafter configured"
            return
        started = time.perf_counter_ns()
        timeout_s = deadlines.bounded(self.policy.draft_timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                self._draft = await self.drafter.open(
                    self.session_id, self.request.prompt_ids, self.vocab_fingerprint, self._sampling
                )
        except (DrafterFailed, TimeoutError) as exc:
            deadlines.check()  # the request's deadline passed, not the drafter's
            self._drop_drafter(exc)
        finally:
            self.stats.draft_ns += time.perf_counter_ns() - started

    async def _propose(self, max_nodes: int, prefix: tuple[int, ...] = ()) -> tuple[TokenTree, bool]:
        """The round's tree, and whether it is the drafter's (an empty tree when there is none).

        ``prefix``: tokens the constraint forces next; the drafter's tree starts with them."""
        if self.request.speculation.mode is SpeculationMode.OFF:
            return TokenTree(), False
        if max_nodes == 0 and self._draft is not None:
            # Nothing to draft this round: the commit report waits for the next request (or the final one).
            return TokenTree(), False
        tree = await self._ask_drafter(max_nodes, prefix) if self._draft is not None else None
        if tree is None:
            self.stats.num_rounds_without_drafter += 1
            return TokenTree(), False
        self.stats.num_drafter_trees += 1
        return tree, True

    async def _ask_drafter(self, max_nodes: int, prefix: tuple[int, ...] = ()) -> TokenTree | None:
        """Send the last round's report and get a tree; None (and the drafter dropped) on failure."""
        assert self._draft is not None
        phases = self._phases
        self._asked_drafter = self._asked_drafter or max_nodes > 0
        protobuf_before = phases.protobuf_ns if phases is not None else 0
        started = self.clock()
        timeout_s = deadlines.bounded(self.policy.draft_timeout_s)
        drafter_ns = 0
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._draft.propose(self._feedback(prefix), max_nodes)
            drafter_ns = reply.draft_ns
            self._count_predraft(reply)
            self._features_wanted = reply.wants_features
        except (DrafterFailed, TimeoutError) as exc:
            deadlines.check()  # the request's deadline passed, not the drafter's
            self._drop_drafter(exc)
            return None
        finally:
            waited_ns = self.clock() - started
            self.stats.draft_ns += waited_ns
            self._draft_wait_ns = waited_ns
            if phases is not None:
                phases.drafted(waited_ns, drafter_ns, phases.protobuf_ns - protobuf_before)
        # The draft budget counts what drafted rounds usually wait for, not the drafter's probes of its sources.
        self._draft_wait_ns = max(0, waited_ns - reply.probe_ns)
        limits = self.policy.tree_limits
        if limits is not None and self._grammar is not None:
            # The fit cuts a constrained tree to the verifier's depth; a drafter told a forced prefix cannot know
            # how deep its draft under it may go.
            limits = replace(limits, max_depth=0)
        with phases.span("tree_and_masks") if phases is not None else contextlib.nullcontext():
            problem = tree_problem(reply.tree, limits, max_nodes) if limits is not None else None
        if problem is not None:
            # Sent on, it would make the verifier refuse the round: the round goes on with an empty tree.
            self._drafter_misbehaved(f"sent a bad tree: {problem}")
            return None
        return reply.tree

    def _count_predraft(self, reply: DraftReply) -> None:
        if reply.predrafted:
            self.stats.num_predraft_hits += 1
            self.stats.predraft_hidden_ns += reply.predraft_ns

    @property
    def _wants_features(self) -> bool:
        return self._draft is not None and self._draft.wants_features

    @property
    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers the drafter's head reads, named in every Prefill of the session (re-prefills too:
        the verifier keeps them with the session for its Verifies' features); empty: the final hidden state."""
        return self._draft.feature_layers if self._draft is not None and self._draft.wants_features else ()

    def _session_prefill(self, return_features: bool) -> SessionPrefill:
        """The Prefill that (re)creates the verifier session from the tokens committed so far."""
        return SessionPrefill(
            self.session_id, tuple(self._committed), self._sampling, return_features, self._feature_layers
        )

    def _asks_features(self, prompt: bool = False) -> bool:
        """Whether a Verify (``prompt``: the Prefill) asks the verifier for the target's features.

        A drafter that takes them sparsely gets a round's only where the reply with the round's tree wants them:
        a round that asked for no tree (no draft budget) has none, so a session the verifier's budget keeps
        plain costs what plain decoding costs, and the head restarts from the features of the round after. The
        prompt's always come (a head that drafts at all needs its context). An older drafter gets every
        position's.
        """
        draft = self._draft
        if draft is None or not draft.wants_features:
            return False
        return prompt or not draft.sparse_features or self._features_wanted

    def _keep_features(self, features: np.ndarray | None, rows: int, asked: bool) -> None:
        """Queue the target's features for the drafter: exactly ``rows`` of them where they were ``asked`` for.

        A call that asked for none leaves a gap, and the rows queued before it go: a report's rows are one run,
        the last positions before its newest token, and cannot say where an earlier run stopped.
        """
        if not self._wants_features:
            return
        if not asked:
            if rows:
                self._unreported_features = []
            return
        if features is None or features.shape[0] < rows:
            # The drafter's model cannot follow without them; the request goes on without the drafter.
            got = "no" if features is None else features.shape[0]
            self._drop_drafter(DrafterFailed(f"the verifier returned {got} feature rows where {rows} were expected"))
            return
        self._unreported_features.append(features[:rows])

    def _feedback(self, forced_prefix: tuple[int, ...] = ()) -> DraftFeedback:
        """The last round's report for the drafter; taking it marks it as sent."""
        features = np.concatenate(self._unreported_features) if self._unreported_features else None
        feedback = DraftFeedback(
            tuple(self._unreported),
            tuple(self._successors),
            features,
            accepted_node_indices=self._accepted_nodes,
            forced_prefix=forced_prefix,
            lookahead_ngrams=self._lookahead_ngrams,
        )
        self._unreported, self._successors, self._unreported_features = [], [], []
        self._lookahead_ngrams = ()
        self._accepted_nodes = ()
        return feedback

    async def _prefill(self) -> None:
        """Create the verifier session; when its replica fails, on another one (the router moved it)."""
        for _ in range(self.policy.max_reprefills_per_round):
            asked = self._asks_features(prompt=True)
            try:
                prefill = await self.verifier.prefill(self._session_prefill(return_features=asked))
            except SessionMoved:
                self.stats.num_reprefills += 1
                continue
            self.stats.verify_ns += prefill.prefill_ns
            self.stats.prefill_ns += prefill.prefill_ns
            self.stats.num_cached_prompt_tokens = prefill.cached_tokens
            # Features come for the positions the verifier computed: the last ones, after those it had cached.
            self._keep_features(prefill.features, len(self._committed) - 1 - prefill.cached_tokens, asked)
            return
        raise self._lost_too_often()

    async def _verify(self, tree: TokenTree, fitted: FittedTree | None = None) -> tuple[VerifyResult, TokenTree]:
        """The verifier's result, and the tree it verified (empty when it refused the drafter's).

        ``fitted``: the constraint's masks for ``tree``'s rows (the first row alone when the tree is refused).
        """
        masks: TokenMasks | None = fitted.masks if fitted is not None else None
        # A round a Verify was sent ahead for is plain (``_propose_verify_commit``): that call is its first attempt.
        ahead, self._ahead = self._ahead, None
        lost = False
        for _ in range(self.policy.max_reprefills_per_round):
            try:
                if lost:
                    # The drafter already has the features of these positions: none are asked for.
                    prefill = await self.verifier.prefill(self._session_prefill(return_features=False))
                    self.stats.verify_ns += prefill.prefill_ns
                    self.stats.prefill_ns += prefill.prefill_ns
                    lost = False
                phases = self._phases
                protobuf_before = phases.protobuf_ns if phases is not None else 0
                started = self.clock()
                if ahead is not None:
                    asked, task, ahead = ahead.asked_features, ahead.task, None
                    result = await self._after_sending_ahead(task)
                    self.stats.num_rounds_sent_ahead += 1
                else:
                    asked = self._asks_features()
                    result = await self._call_verify(self._verify_call(tree, masks, asked), plain=not tree.token_ids)
                # A call sent ahead waited in part before this round began: the verifier's time counts only within
                # this round's wait (the verifier counts it from when the previous round's step ended).
                call_ns = self.clock() - started
                verify_ns = min(result.verify_ns, call_ns)
                if phases is not None:
                    phases.verified(call_ns, phases.protobuf_ns - protobuf_before, verify_ns, result.queue_ns)
                self.stats.verify_ns += verify_ns
                self.stats.num_feature_rounds += asked
                return result, tree
            except InvalidArgument as exc:
                self._drop_ahead()
                if not tree.token_ids:
                    raise
                # The verifier refused the drafter's tree (past our checks): this round is plain decoding.
                self._drafter_misbehaved("the verifier rejected its tree", detail=exc.detail)
                tree = TokenTree()
                masks = TokenMasks(masks.bits[:1]) if masks is not None else None
            except (NotFound, FailedPrecondition, SessionMoved):
                # The verifier lost the session (or its replica died): rebuild it from what was committed, on
                # whichever replica now holds it, and verify the same tree again. A call sent ahead expects the
                # session this round would have left: it fails there, and is withdrawn here.
                self._drop_ahead()
                self.stats.num_reprefills += 1
                lost = True
            except BaseException:
                self._drop_ahead()
                raise
        raise self._lost_too_often()

    def _verify_call(
        self, tree: TokenTree, masks: TokenMasks | None, asked: bool, num_committed: int | None = None
    ) -> VerifyCall:
        """The Verify of ``tree`` on the committed tokens (``num_committed``: on that many, for a call sent ahead)."""
        return VerifyCall(
            self.session_id,
            len(self._committed) if num_committed is None else num_committed,
            tree,
            self.policy.num_successors if self._draft is not None else 0,
            asked,
            masks,  # only constrained requests have masks
            # The draft budget counts the wait for the tree (none: a plain round).
            self._draft_wait_ns if tree.token_ids else 0,
            # Lookahead n-grams feed the drafter's pools: worth rows only while a drafter hears of them.
            lookahead=self._draft is not None,
        )

    async def _call_verify(self, call: VerifyCall, plain: bool) -> VerifyResult:
        """The verifier's answer to ``call``; a plain round whose next round is plain too sends that one ahead."""
        if not (plain and self._next_is_plain()):
            return await self.verifier.verify(call)
        return await self._after_sending_ahead(asyncio.ensure_future(self.verifier.verify(call)))

    async def _after_sending_ahead(self, sent: asyncio.Future[VerifyResult]) -> VerifyResult:
        """Await ``sent``, this round's Verify, after sending the next round's where that one is to be plain
        (``_send_ahead``); ``sent`` is withdrawn if the round is cancelled meanwhile."""
        self._send_ahead()
        try:
            return await sent
        finally:
            if not sent.done():
                sent.cancel()

    def _next_is_plain(self) -> bool:
        """Whether the round after this one, a plain round, is to be plain too, so that its Verify can go now.

        Certain where there is no tree to ask for: speculation off, no drafter, or a session whose drafted rounds
        do not pay and stay so one more round (a round that asked the drafter and got no tree is plain, but the
        gate counts it as drafted: a probe goes on). Likely where the verifier's last answer left the session no
        draft budget: it usually says so again, and if not, the budget waits one round (the round a Verify was sent
        ahead for is plain, ``_propose_verify_commit``). Never under a constraint (the next round's masks follow
        this round's token), and only with room for it in the request and the session."""
        if not self.policy.verify_ahead or self._grammar is not None or not self.verifier.keeps_order:
            return False
        if self.request.max_new_tokens - self._num_new < 2 or len(self._committed) + 2 > self.policy.max_session_tokens:
            return False
        if self.request.speculation.mode is SpeculationMode.OFF or self._draft is None or self._draft_budget == 0:
            return True
        return self._gate is not None and not self._asked_drafter and self._gate.stays_plain()

    def _send_ahead(self) -> None:
        """Send the next round's Verify now, while this round's is on its way, where that round is to be plain
        (``_next_is_plain``).

        The verifier queues a session's calls in order and steps one at a time, so the next step starts as soon as
        this one ends instead of a hop later: the hop, the commit and the streaming of this round's text overlap
        the verifier's work. Its call says the session holds this round's count plus one, which only this round's
        success leaves; if this round fails, it fails too and is withdrawn (``_drop_ahead``). Nothing it returns
        is committed but by the next round, in order.
        """
        assert self._ahead is None, "each round takes or withdraws the Verify sent ahead for it"
        if not self._next_is_plain():
            return
        # A round that asked the drafter never sends one ahead (``_next_is_plain``), so no reply's wish for
        # features is pending: this asks what a plain round asks (none from a sparse drafter).
        asked = self._asks_features()
        call = self._verify_call(TokenTree(), None, asked, num_committed=len(self._committed) + 1)
        self._ahead = _Ahead(asyncio.ensure_future(self.verifier.verify(call)), asked)

    def _drop_ahead(self) -> None:
        """Withdraw the Verify sent ahead (the request ended or this round failed); its answer is never used."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self.stats.num_ahead_withdrawn += 1
            ahead.task.cancel()
            ahead.task.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _lost_too_often(self) -> Unavailable:
        return Unavailable(
            f"the verifier lost this request's session {self.policy.max_reprefills_per_round} times in one round; "
            "it is evicting sessions faster than they are used (raise its --max-sessions) or its replicas keep "
            "failing (check the verifier pods)"
        )

    async def _report_final(self) -> None:
        """Tell the drafter the last round's tokens so the n-gram pool learns all of them."""
        if self._draft is not None and self._unreported:
            await self._ask_drafter(0)

    def _drafter_misbehaved(self, reason: str, detail: str = "") -> None:
        """A drafter fault only the round loop sees: counted against the drafter, which is dropped."""
        if self.drafter_monitor is not None:
            self.drafter_monitor.misbehaved(self.session_id, reason)
        self._drop_drafter(DrafterFailed(reason, detail=detail))

    def _drop_drafter(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {self.policy.draft_timeout_s * 1000:.0f} ms"
        else:
            reason = str(exc) or type(exc).__name__
        # A skipped drafter was never asked: its message says why and until when.
        self.stats.drafter_error = str(exc) if isinstance(exc, DrafterSkipped) else f"drafter dropped: {reason}"
        self.stats.drafter_error_detail = getattr(exc, "detail", "")
        draft, self._draft = self._draft, None
        if draft is not None:
            asyncio.get_running_loop().create_task(draft.close())

    async def _close(self) -> None:
        """Free the request's drafter and verifier sessions, to the end even when the request is cancelled.

        Shielded: when the client's deadline passes, gRPC cancels the handler in the same instant as the round
        loop's own deadline fires, so the cancellation can land while the Release is on its way. Abandoned there,
        the verifier would hold the session and its KV cache until its TTL.
        """
        self._drop_ahead()
        closing = asyncio.ensure_future(self._close_sessions())
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(closing)

    async def _close_sessions(self) -> None:
        if self._draft is not None:
            await self._draft.close()
        with contextlib.suppress(Unavailable, DeadlineExceeded):  # the verifier's TTL frees the session
            await self.verifier.release(self.session_id)
