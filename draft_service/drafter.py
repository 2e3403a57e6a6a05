"""Per-session drafting: keep the committed tokens, learn from each round, propose merged trees.

Pre-drafting: while the verifier checks the tree a session proposed, the
drafter drafts the next round for that tree's likeliest outcomes (an accepted
path plus a guess at the verifier's bonus token, as in SSD/Saguaro and
decoupled speculative decoding). When the report shows one of them happened,
its tree is answered at once; otherwise the drafter drafts afresh. Either
way the tree is a draft that the verifier checks, so output never changes.

Under a structured-output constraint the verifier checks another tree than
the drafter's: the coordinator prunes it to what the grammar allows and adds
the tokens the grammar forces (a schema's keys, punctuation), and most
accepted paths end in those. The coordinator then sends the tree it verifies
(``DraftSession.verified``), and the session pre-drafts for that tree's
outcomes, forced tokens included, instead of its own tree's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from draft_service.capped_registry import CappedRegistry
from draft_service.draft_lm import DraftLM
from draft_service.draft_lm_source import DraftLMProposer
from draft_service.draft_tree import EMPTY, DraftTree
from draft_service.head_graphs import TreeGraphs
from draft_service.head_proposer import HeadProposer, TreeShape
from draft_service.head_types import ServingHead
from draft_service.lookahead_source import LookaheadProposer
from draft_service.namespace_state import NamespaceState
from draft_service.ngram_pool import NgramPool
from draft_service.proposers import PoolProposer, PromptLookupProposer, Proposer, TokenRecyclingProposer
from draft_service.session_memory import SESSION, UNBOUNDED, SessionMemory
from draft_service.source_gate import GateCounts, GateHistory, SourceGate
from draft_service.suffix_source import SuffixProposer
from draft_service.tree_builder import (
    AcceptanceStats,
    TreeBuilder,
    VerifyCost,
    is_accepted_path,
    learn_from_acceptance,
    likely_outcomes,
    source_names,
)
from specserve.results import DraftFeedback, DraftReply, VerifiedTree
from specserve.sampling import GREEDY, SamplingParams
from specserve.tenancy import ANONYMOUS
from specserve.token_tree import TokenTree

BYTES_PER_TOKEN = 40
"""A committed token in a Python list: an 8-byte slot and an int object (32 bytes for ids past 256)."""

DEFAULT_MAX_NAMESPACES = 1024
"""Most (vocabulary, pool namespace) pairs whose pools, successor tables and statistics a drafter keeps."""

NGRAM_SOURCES = (
    PromptLookupProposer.name,
    PoolProposer.name,
    TokenRecyclingProposer.name,
    SuffixProposer.name,
    LookaheadProposer.name,
)
ALL_SOURCES = (*NGRAM_SOURCES, HeadProposer.name)
"""The sources a drafter runs from what it ships: the n-gram sources and the packaged draft head."""
SOURCES = (*ALL_SOURCES, DraftLMProposer.name)
"""Every source a drafter knows: ``ALL_SOURCES`` and the draft model's, which needs one (``--draft-model``)."""
DEFAULT_NGRAM_SOURCES = (SuffixProposer.name, TokenRecyclingProposer.name, LookaheadProposer.name)
"""The n-gram sources a drafter runs unless told: the suffix source drafts what prompt lookup and the pool do (it
reads the pool itself), with frequency-scored trees; the lookahead source costs nothing until the verifier sends
lookahead n-grams."""


@dataclass
class PredraftCounts:
    """Pre-drafting's totals over every session since the drafter started (read by metrics)."""

    drafted: int = 0  # trees drafted ahead for a likely outcome of the tree being verified
    used: int = 0  # of those, trees answered at once because their outcome happened
    dropped: int = 0  # sessions' work ahead dropped unstarted from its queue because their report came first


@dataclass(frozen=True)
class _Predraft:
    tree: DraftTree
    draft_ns: int  # what drafting it cost, ahead of time
    gated: bool = False  # the costly sources (SourceGate) drafted it too


class DraftSession:
    """One generation session as the drafter sees it."""

    kind = SESSION

    def __init__(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        pool: NgramPool,
        proposers: Sequence[Proposer],
        builder: TreeBuilder,
        predraft_outcomes: int = 0,
        vocab_size: int = 0,
        memory: SessionMemory | None = None,
        predraft_counts: PredraftCounts | None = None,
        namespace: NamespaceState | None = None,
        gate: SourceGate | None = None,
    ) -> None:
        self.session_id = session_id
        # Whether the costly sources (a model of their own: the head, a draft model) earn their time.
        self._gate = gate if gate is not None else SourceGate()
        self._gated = frozenset(proposer.name for proposer in proposers if proposer.costly or proposer.wants_features)
        self._gate_open = True  # the costly sources draft the trees of this round (and its pre-drafts)
        self._gated_s = 0.0  # their drafting time since this round's drafting began
        self._gated_nodes = 0  # and the nodes they offered
        self._drafted_gated = False  # they drafted the last tree
        self._forgotten = False  # the sources' state was freed (``forget``): the head drafts no more
        self._namespace = namespace  # its pool namespace's shared state: accounted after each step, like the session
        self._predraft_counts = predraft_counts if predraft_counts is not None else PredraftCounts()
        self._memory = memory  # where this session's bytes are counted (and its sources' state may be freed)
        self._vocab_size = vocab_size  # the target's: draft tokens outside it are dropped (0: unknown)
        self.tokens = list(prompt_tokens)
        self._num_prompt_tokens = len(self.tokens)
        self._pool = pool
        self._proposers = proposers
        self._builder = builder
        self._last: DraftTree = EMPTY
        # The last tree is a forced prefix (structured output: the coordinator's, often empty) with the sources'
        # draft under it.
        self._prefix_len = 0
        self._drafted: DraftTree = EMPTY
        self._max_nodes = 0  # the size asked for last: pre-drafted trees are drafted to it
        self._predraft_outcomes = predraft_outcomes
        # Outcomes of the last tree not pre-drafted yet: (accepted path, which bonus guess: 0 the likeliest).
        self._pending_outcomes: list[tuple[tuple[int, ...], int]] = []
        # The tree verified for the last proposal when it is not ours (structured output), and whether the
        # coordinator sends one after each proposal: then pre-drafting waits for it.
        self._verified: VerifiedTree | None = None
        self._sends_verified = False
        self._predrafts: dict[tuple[int, ...], _Predraft] = {}  # outcome (accepted tokens + bonus) -> tree

    @property
    def label(self) -> str:
        return f"session {self.session_id}"

    @property
    def wants_features(self) -> bool:
        return any(proposer.wants_features for proposer in self._proposers)

    @property
    def wants_features_next(self) -> bool:
        """Whether its feature-level sources want the target's features of the round about to be verified: while
        their state is kept. Rounds they sit out (``SourceGate``) still bring them, fed only when they next run:
        a probe that started from one round's features after a gap drafted from too little context to be
        judged fairly. Features they will never read would be computed, sent and kept for nothing: the
        coordinator asks for them only when this says so (``DraftReply.wants_features``)."""
        return self.wants_features and not self._forgotten

    @property
    def predrafts(self) -> bool:
        """Whether it drafts ahead for the outcomes of the tree being verified (``work_ahead``)."""
        return self._predraft_outcomes > 0

    @property
    def nbytes(self) -> int:
        """Memory held for this session: its tokens (a list of ints) and its sources' own state."""
        return BYTES_PER_TOKEN * len(self.tokens) + sum(proposer.nbytes for proposer in self._proposers)

    def forget(self) -> int:
        """Free the sources' state and the pre-drafted trees (drafting degrades, nothing fails); bytes freed."""
        before = self.nbytes
        self._forgotten = True
        for proposer in self._proposers:
            proposer.forget()
        self._predrafts.clear()
        return max(0, before - self.nbytes)

    def close(self) -> None:
        """The stream ended: stop counting this session's memory."""
        if self._memory is not None:
            self._memory.closed(self)

    def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        """Learn from the last round, then propose a tree of at most ``max_nodes``; the reply says whether the
        round it is verified in should bring the target's features (``wants_features_next``)."""
        reply = replace(self._propose(feedback, max_nodes), wants_features=self.wants_features_next)
        self._account()
        return reply

    def work_ahead(self, predraft: bool = True) -> bool:
        """One bounded step of work for the next round; False when there is none left.

        First what the sources put off (a long prompt's features), then, with
        ``predraft``, the next round's tree for the likeliest outcome of the
        last tree not drafted yet. Call between the reply to ``propose`` and the
        next ``propose``, step by step, so that a waiting request can interrupt.
        """
        worked = self._work_ahead(predraft)
        self._account()
        return worked

    def _account(self) -> None:
        if self._memory is not None:
            if self._namespace is not None:
                self._memory.used(self._namespace)
            self._memory.used(self)

    def _propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        try:
            return self._answer(feedback, max_nodes)
        finally:
            self._gate.replied()

    def _answer(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        start = time.perf_counter_ns()
        self._observe(feedback)
        ready = self._predrafts.get(feedback.new_tokens) if feedback.new_tokens else None
        self._predrafts.clear()
        self._max_nodes = max(0, max_nodes)
        self._verified = None
        self._prefix_len, self._drafted = 0, EMPTY
        self._drafted_gated = False
        if max_nodes <= 0:
            self._pool.flush()
            self._last = EMPTY
            self._pending_outcomes = []
            return DraftReply(TokenTree(), time.perf_counter_ns() - start)
        # A constraint forces these next: draft after them, and hang the draft under them.
        prefix = feedback.forced_prefix[:max_nodes]
        room = max_nodes - len(prefix)
        probe_ns = 0
        if ready is not None and prefix:  # usable only where it drafted the forced tokens too
            under = ready.tree.subtree(prefix)
            ready = _Predraft(under, ready.draft_ns, ready.gated) if under is not None and len(under.tree) else None
        if room <= 0:
            ready, drafted = None, EMPTY
        elif ready is not None:
            self._predraft_counts.used += 1
            drafted = ready.tree.cut(room)
            self._drafted_gated = ready.gated
        else:
            self._gate_open = bool(self._gated) and self._gate.opens()
            self._gated_s, self._gated_nodes = 0.0, 0
            drafted = self._draft([*self.tokens, *prefix], room)
            if self._gate_open:
                probe_ns = round(self._gated_s * 1e9) if self._gate.probing else 0
                if self._gated_nodes:
                    self._gate.ran(self._gated_s)
                else:
                    self._gate.had_nothing()
            else:
                self._gate.sat_out()
            self._drafted_gated = self._gate_open and self._gated_nodes > 0
        self._last = drafted.grafted_under(prefix)
        self._prefix_len, self._drafted = len(prefix), drafted
        # With a constraint the tree verified is not this one: its outcomes come with it (``verified``).
        outcomes = [] if self._sends_verified else likely_outcomes(self._last, self._predraft_outcomes)
        self._pending_outcomes = [(path, 0) for path in outcomes]
        elapsed = time.perf_counter_ns() - start
        if ready is not None:
            return DraftReply(self._last.tree, elapsed, predrafted=True, predraft_ns=ready.draft_ns)
        return DraftReply(self._last.tree, elapsed, probe_ns=min(probe_ns, elapsed))

    def verified(self, verified: VerifiedTree) -> None:
        """The verifier checks ``verified`` for the last proposal, not our tree: pre-draft for its outcomes.

        Under a constraint the coordinator pruned our tree and hung the tokens the grammar forces under its
        nodes; an accepted path that runs into forced tokens (as most do) is one our own tree never spells, so
        its pre-draft would never be used. From now on the session waits for this tree after each proposal
        before pre-drafting. Call between the reply to ``propose`` and any work ahead for it.

        Where the likeliest path ends in a forced token, that path is as likely as its last drafted node and
        only the bonus token after it is in doubt (after a key, ``": "`` or ``": 4``?): a second guess at it
        takes the place of the last path, unless the grammar leaves one token there.
        """
        self._sends_verified = True
        if self._max_nodes <= 0:
            return  # no tree was asked for: nothing to draft ahead
        self._verified = verified
        outcomes = likely_outcomes(self._last.estimates_for(verified), self._predraft_outcomes, verified.forced)
        pending = [(path, 0) for path in outcomes]
        if outcomes and outcomes[0]:
            end = verified.tree.node_at(outcomes[0])
            allowed = verified.allowed_next.get(end)
            if verified.is_forced(end) and (allowed is None or len(allowed) > 1):
                pending.insert(1, (outcomes[0], 1))
        self._pending_outcomes = pending[: self._predraft_outcomes]

    def _work_ahead(self, predraft: bool) -> bool:
        # Costly sources sitting out feed no features ahead: they catch up when they next run (a probe).
        feeding = [p for p in self._proposers if not (p.name in self._gated and self._gate.sitting_out)]
        if any(proposer.digest(self.tokens) for proposer in feeding):
            return True
        if not predraft or not self._pending_outcomes:
            return False
        start = time.perf_counter_ns()
        accepted, guess = self._pending_outcomes.pop(0)
        context = [*self.tokens, *accepted]
        bonus = self._guess_bonus(context, accepted, guess)
        if bonus is not None:
            tree = self._draft([*context, bonus], self._max_nodes)
            elapsed = time.perf_counter_ns() - start
            gated = self._gate_open and any(self._gated & source_names(sources) for sources in tree.sources)
            self._predrafts[(*accepted, bonus)] = _Predraft(tree, elapsed, gated)
            self._predraft_counts.drafted += 1
        return True

    def _guess_bonus(self, context: list[int], accepted: tuple[int, ...], guess: int = 0) -> int | None:
        """The sources' likeliest next token after ``context`` that the tree verified did not offer there
        (``guess`` 1: the next one, another source's pick); None when they have no such guess.

        The verifier's bonus token follows the accepted path; had it been one
        of the tree's children there, that child would have been accepted.
        Under a constraint that allows few tokens there, it is one of those:
        the sources' picks among them first, then the others in id order (the
        only one left, for certain, when the tree offered the others).
        """
        verified = self._verified
        tree = verified.tree if verified is not None else self._last.tree
        node = tree.node_at(accepted)
        offered = {tree.token_ids[c] for c in tree.children()[node]}
        allowed = verified.allowed_next.get(node) if verified is not None else None
        left = [token for token in allowed if token not in offered] if allowed is not None else None
        if left is not None and len(left) <= 1:
            return left[0] if left and guess == 0 else None
        first = self._builder.first_tokens(self._proposals(context, len(offered) + 1))
        guesses = [token for token in first if token not in offered and (left is None or token in left)]
        guesses += [token for token in left or () if token not in guesses]
        return guesses[guess] if guess < len(guesses) else None

    def _learn(self, accepted: Sequence[int]) -> int | None:
        """Credit the sources for the last tree; its forced prefix is not theirs, and their draft under it is
        credited at its own depths (as drafted after the prefix), which is what their statistics estimate.
        Returns the accepted nodes that only the costly sources drafted (None: they did not draft the tree)."""
        k = self._prefix_len
        if len(accepted) < k:  # the prefix is certain: a shorter path means the round was cut (length, EOS)
            return None
        own = [node - k for node in accepted[k:]]
        learn_from_acceptance(self._builder.stats, self._drafted, own)
        if not self._drafted_gated:
            return None
        credited = (source_names(self._drafted.sources[node]) for node in own)
        return sum(1 for names in credited if names and names <= self._gated)

    def _draft(self, tokens: list[int], max_nodes: int) -> DraftTree:
        return self._builder.build(self._proposals(tokens, max_nodes), max_nodes)

    def _proposals(self, tokens: list[int], max_nodes: int) -> list[tuple[str, TokenTree]]:
        proposals = []
        for proposer in self._proposers:
            gated = proposer.name in self._gated
            if gated and not self._gate_open:
                continue
            start = self._gate.clock()
            # A source may hold ids that are not the target's (a poisoned shared pool): they never leave.
            proposals.append((proposer.name, proposer.propose(tokens, max_nodes).within_vocab(self._vocab_size)))
            if gated:
                self._gated_s += self._gate.clock() - start
                self._gated_nodes += len(proposals[-1][1])
        return proposals

    def _observe(self, feedback: DraftFeedback) -> None:
        if feedback.new_tokens:
            accepted = feedback.accepted_node_indices
            # The verifier's indices refer to the tree it checked: learn only if that was our last tree.
            gain = self._learn(accepted) if is_accepted_path(self._last.tree, accepted, feedback.new_tokens) else None
            self._gate.committed(len(feedback.new_tokens), gain)
            previous = len(self.tokens)
            self.tokens.extend(feedback.new_tokens)
            # Only generated output teaches the shared pool; a window's key may reach into the prompt.
            self._pool.record(self.tokens, start=max(previous, self._num_prompt_tokens))
        if feedback.features is not None:
            # The rows are the features of the last positions before the newest token: the sources learn where.
            feedback = replace(feedback, features_start=len(self.tokens) - 1 - feedback.features.shape[0])
        for proposer in self._proposers:
            proposer.observe(feedback)


class Drafter:
    """Opens draft sessions; owns what sessions share (pools, successor tables, acceptance statistics)."""

    def __init__(
        self,
        pool_for: Callable[[str, str], NgramPool],  # (vocabulary fingerprint, pool namespace) -> pool
        prompt_lookup: PromptLookupProposer | None = None,
        sources: Sequence[str] = DEFAULT_NGRAM_SOURCES,
        cost: VerifyCost | None = None,
        draft_head: ServingHead | None = None,  # ours or a published EAGLE-3 head
        tree_shape: TreeShape | None = None,
        predraft_outcomes: int = 0,
        memory: SessionMemory | None = None,
        coupled_sampling: bool = True,
        max_namespaces: int = DEFAULT_MAX_NAMESPACES,
        draft_lm: DraftLM | None = None,
        # (vocabulary fingerprint, pool namespace) -> the lookahead n-grams' pool (None: each session's own only)
        lookahead_pool_for: Callable[[str, str], NgramPool] | None = None,
    ) -> None:
        unknown = set(sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown draft sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
        if HeadProposer.name in sources and draft_head is None:
            raise ValueError(f"the {HeadProposer.name} source needs a draft head (weights)")
        self._head = draft_head if HeadProposer.name in sources else None
        if DraftLMProposer.name in sources and draft_lm is None:
            raise ValueError(f"the {DraftLMProposer.name} source needs a draft model (--draft-model)")
        self._draft_lm = draft_lm if DraftLMProposer.name in sources else None
        self._tree_shape = tree_shape or TreeShape()
        # A GPU head grows greedy trees in captured graphs, shared by its sessions.
        head = self._head
        self._tree_graphs = TreeGraphs(head) if head is not None and head.draft_lm_head.device.type == "cuda" else None
        self._pool_for = pool_for
        self._lookahead_pool_for = lookahead_pool_for
        self._prompt_lookup = prompt_lookup or PromptLookupProposer()
        self.sources = tuple(sources)
        self._cost = cost or VerifyCost()
        # Per (vocabulary, pool namespace), least recently opened first: successor tables (the target's top tokens
        # after each token are the tenant's text too) and acceptance statistics, in the memory bound; at most
        # ``max_namespaces`` of them (the keys are what callers send).
        if max_namespaces < 1:
            raise ValueError(f"the drafter must keep at least one pool namespace, got {max_namespaces}")
        self.max_namespaces = max_namespaces
        self._namespaces: CappedRegistry[tuple[str, str], NamespaceState] = CappedRegistry(
            max_namespaces, self._new_namespace, lambda key, state: self._drop(state)
        )
        # Outcomes of each tree to draft ahead for while it is verified (0: no pre-drafting). Worth it only
        # where drafting has its own cores: in one process with the verifier it would take the verifier's.
        self.predraft_outcomes = predraft_outcomes
        # Sampled sessions' head and draft-model drafts use the target's keyed noise (coupled); off: their top-k.
        self.coupled_sampling = coupled_sampling
        # Open sessions' and namespaces' bytes, bounded (--max-memory-mib): the least recently used ones' state goes.
        self.memory = memory if memory is not None else SessionMemory(max_bytes=UNBOUNDED)
        self.predraft_counts = PredraftCounts()
        self.gate_counts = GateCounts()  # every session's SourceGate decisions, for metrics
        self.gate_history = GateHistory()  # what every session learnt of the costly sources: new sessions' priors

    @property
    def wants_features(self) -> bool:
        """The draft head drafts from the target's features: the coordinator must forward them."""
        return self._head is not None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the draft head reads, concatenated per row; empty: the final hidden
        state (also with no head)."""
        return self._head.feature_layers if self._head is not None else ()

    @property
    def vocab_fingerprint(self) -> str:
        """The vocabulary the draft head or draft model needs; empty when only n-gram sources draft (any
        vocabulary). Both were checked against the same target at start-up."""
        if self._head is not None:
            return self._head.target_fingerprint
        return self._draft_lm.fingerprint if self._draft_lm is not None else ""

    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        vocab_size: int = 0,
        pool_namespace: str = "",
        verify_cost: VerifyCost | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> DraftSession:
        """A session for a target of ``vocab_fingerprint``; ValueError when the draft head or model cannot serve it.

        ``vocab_size``: the target's (0: unknown); draft tokens outside it are dropped. ``pool_namespace``: the
        tenant's n-gram pool and successor table (``Tenant.pool_namespace``; empty: the anonymous tenant's).
        ``verify_cost``: what verification costs on the session's verifier (its measured curve); None: this
        drafter's own (``cost``). ``sampling``: how the target samples the session, seed included; at temperature
        > 0 the draft head drafts with the target's keyed noise (``coupled_sampling``).
        """
        if self._head is not None and self._head.target_fingerprint not in ("", vocab_fingerprint):
            raise ValueError(
                f"this drafter's draft head was trained for the vocabulary {self._head.target_fingerprint}, "
                f"the session's target has {vocab_fingerprint}: start the drafter with a head for that target"
            )
        if self._draft_lm is not None and self._draft_lm.fingerprint not in ("", vocab_fingerprint):
            raise ValueError(
                f"this drafter's draft model {self._draft_lm.name} has the vocabulary {self._draft_lm.fingerprint}, "
                f"the session's target has {vocab_fingerprint}: start the drafter with a draft model of that target's "
                "family (--draft-model)"
            )
        namespace = pool_namespace or ANONYMOUS.pool_namespace
        pool = self._pool_for(vocab_fingerprint, namespace)
        if vocab_size > 0:
            pool.limit_vocab(vocab_size)
        state = self._namespace(vocab_fingerprint, namespace)
        # Built only for the sources this drafter runs: the suffix source copies and indexes the prompt.
        available: dict[str, Callable[[], Proposer]] = {
            PromptLookupProposer.name: lambda: self._prompt_lookup,
            PoolProposer.name: lambda: PoolProposer(pool),
            TokenRecyclingProposer.name: lambda: TokenRecyclingProposer(state.successors),
            SuffixProposer.name: lambda: SuffixProposer(prompt_tokens, pool),
            LookaheadProposer.name: lambda: LookaheadProposer(
                self._lookahead_pool(vocab_fingerprint, namespace, vocab_size)
            ),
        }
        head = self._head
        if head is not None:
            coupled = sampling if self.coupled_sampling else GREEDY
            available[HeadProposer.name] = lambda: HeadProposer(head, self._tree_shape, coupled, self._tree_graphs)
        draft_lm = self._draft_lm
        if draft_lm is not None:
            lm_sampling = sampling if self.coupled_sampling else GREEDY
            available[DraftLMProposer.name] = lambda: DraftLMProposer(
                draft_lm, prompt_tokens, self._tree_shape, lm_sampling
            )
        shared = state.stats(sampling.greedy)
        builder = TreeBuilder(AcceptanceStats(parent=shared), verify_cost or self._cost)
        built = {name: available[name]() for name in dict.fromkeys(self.sources)}  # a source named twice: one
        proposers = [built[name] for name in self.sources]
        session = DraftSession(
            session_id,
            prompt_tokens,
            pool,
            proposers,
            builder,
            self.predraft_outcomes,
            vocab_size,
            self.memory,
            self.predraft_counts,
            state,
            SourceGate(counts=self.gate_counts, history=self.gate_history),
        )
        self.memory.opened(session)
        return session

    def _lookahead_pool(self, fingerprint: str, namespace: str, vocab_size: int) -> NgramPool | None:
        """The namespace's lookahead pool, limited to the target's vocabulary (None: none configured)."""
        if self._lookahead_pool_for is None:
            return None
        pool = self._lookahead_pool_for(fingerprint, namespace)
        if vocab_size > 0:
            pool.limit_vocab(vocab_size)
        return pool

    @property
    def num_namespaces(self) -> int:
        return len(self._namespaces)

    def _namespace(self, fingerprint: str, namespace: str) -> NamespaceState:
        """The state of (``fingerprint``, ``namespace``), made most recent; beyond the cap the least recent goes."""
        return self._namespaces.get((fingerprint, namespace))

    def _new_namespace(self, key: tuple[str, str]) -> NamespaceState:
        state = NamespaceState(*key)
        self.memory.opened(state)
        return state

    def _drop(self, state: NamespaceState) -> None:
        state.retire()  # its sessions still open go on without a successor table
        self.memory.closed(state)

    def forget_successors(self, pool_namespace: str) -> int:
        """Drop the successor tables and acceptance statistics of ``pool_namespace`` (a purge); how many tables."""
        keys = [key for key in self._namespaces if key[1] == pool_namespace]
        for key in keys:
            self._drop(self._namespaces.pop(key))
        return len(keys)
