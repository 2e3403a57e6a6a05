"""The verifier: the target model serving many sessions at once.

A session's KV cache holds every committed token except the last one, which
is "pending": each Verify forwards the pending token followed by the draft
nodes, so the target scores the draft and produces its bonus token in one
forward pass. The cache is then cut back to the committed tokens (the pending
token plus the accepted path); the new bonus token becomes the pending one.
A tree of size zero is plain decoding.

Prefill, Verify and Release calls from any thread go into one queue. A single
engine thread owns the model, the KV arena and the sessions: each step it
takes what is waiting, up to a token budget and a session budget (Verify
calls first in arrival order, then prefill chunks, so a long prompt never
holds running streams for more than one step), runs ONE forward over all of
it (``ModelRunner`` over a ragged ``StepPlan``), then applies each caller's
acceptance and answers it. A caller whose request fails (a bad tree, no
memory, a sampling error) gets its own error; the rest of the batch goes on.

Memory is admitted in bytes (``session_cache``): a call that finds no room
even after evicting idle sessions waits in the queue, and after
``admission_timeout_s`` gets RESOURCE_EXHAUSTED. An evicted session's next
Verify gets NOT_FOUND and the coordinator prefills it again from its
committed tokens, so no token is lost or repeated.

This module is the scheduler (what runs next) and the public API; the parts
it drives live beside it: ``engine_calls`` (what is queued), ``session_cache``
(sessions and memory), ``step_inputs`` (pack and unpack a step),
``model_runner`` (the forward) and ``tree_acceptance`` (what a session keeps).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch

from specserve.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SpecserveError,
    Unavailable,
)
from specserve.results import PrefillResult, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_masks import InvalidTokenMasksError, TokenMasks
from specserve.token_tree import InvalidTreeError, TokenTree
from target_service import step_inputs
from target_service.budget_policy import DraftBudget
from target_service.config import VerifierConfig
from target_service.cost_curve import CostCurve, flat_curve, measure_context_cost, measure_curve
from target_service.engine_calls import Call, PrefillCall, ReleaseCall, StepWork, VerifyCall, fail, resolve
from target_service.engine_threads import compute_on_this_thread
from target_service.kv_arena import KVArena
from target_service.layer_features import check_layers
from target_service.lookahead import LookaheadWindow, check_settings, nearly_free
from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan
from target_service.session_cache import PREFILL_HEADROOM_TOKENS, Session, SessionCache
from target_service.throughput_guard import ThroughputGuard
from target_service.tree_acceptance import accept, commit, masked_logits

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["PREFILL_HEADROOM_TOKENS", "EngineStats", "EngineStep", "Verifier", "VerifierLimits"]

# The start-up profile times its sizes over the first context, then sizes up to PROFILE_CONTEXT_MAX_ROWS over
# both, for what attention adds per row per cached token (``CostCurve.per_row_context_s``). Spec-Bench's prompts
# run to ~700 tokens and a long answer's context grows past 1000.
PROFILE_CONTEXTS = (128, 1024)
PROFILE_CONTEXT_MAX_ROWS = 16


@dataclass(frozen=True)
class VerifierLimits:
    max_tree_nodes: int
    max_tree_depth: int
    max_sessions: int
    max_session_tokens: int
    max_batch_tokens: int
    max_batch_sessions: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for VerifierInfo and metrics."""

    num_sessions: int
    num_queued: int
    kv_capacity_bytes: int
    kv_used_bytes: int  # held by sessions (not by kept caches, which any session may take)
    num_steps: int
    num_evicted: int
    num_kept_caches: int = 0  # released sessions' caches kept for new sessions to start from
    num_prefix_reuses: int = 0  # sessions that started from one
    num_reused_tokens: int = 0  # the prompt tokens they copied instead of prefilling


@dataclass(frozen=True)
class EngineStep:
    """What one engine step served: what ``observe_steps`` observers (metrics) get after each forward."""

    num_sessions: int  # Verify calls and prefill chunks in the one forward (the batch size)
    num_tokens: int  # tokens in the forward: each Verify's pending token and tree nodes, each prefill chunk
    # ("verify" or "prefill", seconds from submission to this step) of each call this step served first
    queued_s: tuple[tuple[str, float], ...] = ()
    lookahead_rows: int = 0  # Jacobi lookahead rows the step ran beside the trees (in ``num_tokens`` too)
    lookahead_ngrams: int = 0  # n-grams they yielded, returned to their callers
    step_s: float = 0.0  # the step's time: packing, the forward, each call's acceptance and answer


class Verifier:
    """Holds the target model and its sessions; every public method is thread-safe."""

    supports_branching = True

    def __init__(
        self,
        model: Any,
        vocab_fingerprint: str,
        *,
        model_name: str = "",
        max_sessions: int = 64,
        session_ttl_s: float = 600.0,
        max_tree_nodes: int = 64,
        max_tree_depth: int = 32,
        max_session_tokens: int = 0,
        kv_cache_bytes: int = 256 * 2**20,
        max_batch_tokens: int = 256,
        max_batch_sessions: int = 64,
        admission_timeout_s: float = 30.0,
        evict_idle_s: float = 2.0,
        cost_curve: CostCurve | None = None,
        throughput_guard: bool = True,
        compile: str = "auto",
        weights: str = "dtype",
        engine_threads: int = 0,
        lookahead: str = "auto",
        lookahead_window: int = 8,
        lookahead_ngram: int = 4,
        kept_prefixes: int = 32,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """``engine_threads``: the torch threads the engine's steps run on (0: torch's count now). The engine
        thread sets them for itself (``target_service.engine_threads``).

        ``lookahead``: whether Verify calls that ask for lookahead get Jacobi rows (``target_service.lookahead``):
        "on" wherever the step has the rows, "auto" only where the cost curve says they are nearly free, "off"
        never; ``lookahead_window`` columns by ``lookahead_ngram`` - 1 levels, yielding n-grams of that size.

        ``kept_prefixes``: released sessions' caches kept for new sessions that start with the same tokens
        (``target_service.kept_prefixes``; 0: none).

        ``clock``: nanoseconds, read for every time the engine measures: when a call is queued, its queue time,
        each step's time, the prefill and verify times it answers, the admission timeout and the activity log.
        One clock for all of them, so a test can inject a fake one and assert those figures exactly, with no
        sleeps (``time.perf_counter_ns`` by default: monotonic, the finest resolution). Waits on real events
        (``wait_idle``, the engine's idle naps) stay on real time: they are not measurements.
        """
        self._clock = clock
        check_settings(lookahead, lookahead_window, lookahead_ngram)
        self._lookahead = lookahead
        self._lookahead_window = lookahead_window
        self._lookahead_ngram = lookahead_ngram
        self._engine_threads = engine_threads or torch.get_num_threads()
        self._runner = ModelRunner(model, compile, weights=weights)
        self.model_name = model_name
        self.vocab_fingerprint = vocab_fingerprint
        self.vocab_size = self._runner.vocab_size
        self.hidden_size = self._runner.hidden_size
        context = self._runner.max_positions
        if max_batch_tokens < max_tree_nodes + 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must hold one full tree ({max_tree_nodes} + 1)")
        self.limits = VerifierLimits(
            max_tree_nodes=max_tree_nodes,
            max_tree_depth=max_tree_depth,
            max_sessions=max_sessions,
            max_session_tokens=min(max_session_tokens, context) if max_session_tokens > 0 else context,
            max_batch_tokens=max_batch_tokens,
            max_batch_sessions=max_batch_sessions,
        )
        self._arena: KVArena = self._runner.new_arena(kv_cache_bytes // self._runner.kv_bytes_per_token)
        self.dtype = str(self._runner.dtype).removeprefix("torch.")
        self._budget = DraftBudget(cost_curve or flat_curve(), max_tree_nodes)
        self._admission_timeout_ns = int(admission_timeout_s * 1e9)
        self._sessions = SessionCache(
            self._arena,
            max_sessions,
            session_ttl_s,
            self.limits.max_session_tokens,
            evict_idle_s,
            busy=self._busy_sessions,
            max_kept=kept_prefixes,
        )
        self._queue: deque[Call] = deque()
        # Work that must run on the engine thread between steps (``_on_engine_thread``): the cost profile.
        self._tasks: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._parking = False  # park(): the engine thread ends once it has no work
        self._parked = False  # it has ended; the next call starts another
        self._paused = False
        self._busy = False  # a step is being built or run
        self._num_steps = 0
        self._in_step: set[str] = set()  # sessions with a call in the step being built: never evicted
        self._step_calls: list[Call] = []
        self._activity = _ActivityLog(clock)
        self._guard = ThroughputGuard(lambda: clock() / 1e9) if throughput_guard else _NeverProbe()
        self._recent_sessions = 1.0  # smoothed number of sessions per step, for the draft budget
        self._step_observers: list[Callable[[EngineStep], None]] = []
        self._started: Future[None] = Future()
        self._thread = threading.Thread(target=self._engine, name="verifier-engine", daemon=True)
        self._thread.start()
        self._started.result()  # the step's graphs are captured or compiled on the engine thread, before any call

    @classmethod
    def from_config(
        cls,
        model: Any,
        vocab_fingerprint: str,
        config: VerifierConfig,
        profile: bool = True,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> Verifier:
        """A verifier over an already loaded ``model`` with the limits ``config`` sets.

        ``profile`` measures the engine's cost curve first (a few seconds), which sizes the draft budget;
        main.py keeps the measured curve in the model cache and passes profile=False when it has one.
        ``clock``: what the engine measures its times with (``__init__``); services keep the default.
        """
        verifier = cls(
            model,
            vocab_fingerprint,
            model_name=config.model,
            max_sessions=config.max_sessions,
            session_ttl_s=config.session_ttl_s,
            max_tree_nodes=config.max_tree_nodes,
            max_tree_depth=config.max_tree_depth,
            max_session_tokens=config.max_session_tokens,
            kv_cache_bytes=int(config.kv_cache_gib * 2**30),
            max_batch_tokens=config.max_batch_tokens,
            max_batch_sessions=config.max_batch_sessions,
            admission_timeout_s=config.admission_timeout_s,
            evict_idle_s=config.evict_idle_s,
            throughput_guard=config.throughput_guard,
            compile=config.compile,
            weights=config.weights,
            engine_threads=config.torch_threads,
            lookahead=config.lookahead,
            lookahead_window=config.lookahead_window,
            lookahead_ngram=config.lookahead_ngram,
            kept_prefixes=config.kept_prefixes,
            clock=clock,
        )
        if profile and config.profile_cost:
            verifier.profile_cost()
        return verifier

    # ---- public API (any thread) ----

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def num_active_sessions(self) -> int:
        return len(self._sessions)

    def holds(self, session_id: str) -> bool:
        """Whether the session has its KV cache here (a read of the engine's map: any thread may ask)."""
        return self._sessions.peek(session_id) is not None

    @property
    def cost_curve(self) -> CostCurve:
        return self._budget.curve

    def observe_steps(self, observer: Callable[[EngineStep], None]) -> None:
        """Call ``observer`` on the engine thread after each step's forward (keep it cheap: it holds the engine)."""
        self._step_observers.append(observer)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_sessions=len(self._sessions),
            num_queued=len(self._queue),
            kv_capacity_bytes=self._arena.capacity_bytes,
            # Kept caches give their memory to the first session that needs it: not counted as used.
            kv_used_bytes=self._arena.used_bytes - self._sessions.kept.num_slots * self._arena.bytes_per_token,
            num_steps=self._num_steps,
            num_evicted=self._sessions.num_evicted,
            num_kept_caches=len(self._sessions.kept),
            num_prefix_reuses=self._sessions.kept.num_reused,
            num_reused_tokens=self._sessions.kept.num_reused_tokens,
        )

    def prefill(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        return_features: bool = False,
        feature_layers: Sequence[int] = (),
    ) -> PrefillResult:
        """Create (or replace) a session holding ``token_ids``.

        With ``return_features``, the result holds the target's last hidden
        state at every position but the last (whose token is pending); with
        ``feature_layers`` too, that session's features (here and in its
        Verifies) are those layers' inputs, concatenated per row
        (``layer_features``).
        """
        future = self.submit_prefill(session_id, token_ids, sampling, return_features, feature_layers=feature_layers)
        result: PrefillResult = future.result()
        return result

    def submit_prefill(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        return_features: bool = False,
        owner: str = "",
        feature_layers: Sequence[int] = (),
    ) -> Future[PrefillResult]:
        """Queue a prefill; cancelling the future before it completes frees what it held.

        The session belongs to ``owner``: a prefill, verify or release by anyone else is PermissionDenied.
        """
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        try:
            layers = check_layers(feature_layers, self._runner.num_layers)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        if not token_ids:
            raise InvalidArgument("prefill needs at least one token")
        self._check_tokens(token_ids, "prefill token")
        if len(token_ids) >= self.limits.max_session_tokens:
            raise InvalidArgument(
                f"{len(token_ids)} tokens do not fit the context: at most "
                f"{self.limits.max_session_tokens - 1} leave room for one new token"
            )
        try:
            sampling.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        needed = len(token_ids) * self._arena.bytes_per_token
        if needed > self._arena.capacity_bytes:
            raise ResourceExhausted(
                f"{len(token_ids)} tokens need {needed / 2**20:.1f} MiB of KV cache, more than the verifier's "
                f"{self._arena.capacity_bytes / 2**20:.1f} MiB: raise --kv-cache-gib or send a shorter prompt"
            )
        call = PrefillCall(
            session_id,
            owner,
            tokens=list(token_ids),
            sampling=sampling,
            return_features=return_features,
            feature_layers=layers,
        )
        return self._submit(call)

    def verify(
        self,
        session_id: str,
        num_committed: int,
        tree: TokenTree,
        num_successors: int = 0,
        return_features: bool = False,
        token_masks: TokenMasks | None = None,
        draft_ns: int = 0,
        lookahead: bool = False,
    ) -> VerifyResult:
        """Verify ``tree`` on top of the session.

        ``num_successors`` > 0 also returns that many of the target's likeliest next tokens at every scored
        position (for Token Recycling); ``return_features`` its hidden states at the committed ones.
        ``token_masks`` (structured output) limits the tokens the target may pick at each scored row.
        ``draft_ns``: how long the tree took to draft (``submit_verify``); ``lookahead``: also Jacobi rows.
        """
        result: VerifyResult = self.submit_verify(
            session_id,
            num_committed,
            tree,
            num_successors,
            return_features,
            token_masks=token_masks,
            draft_ns=draft_ns,
            lookahead=lookahead,
        ).result()
        return result

    def submit_verify(
        self,
        session_id: str,
        num_committed: int,
        tree: TokenTree,
        num_successors: int = 0,
        return_features: bool = False,
        owner: str = "",
        token_masks: TokenMasks | None = None,
        draft_ns: int = 0,
        lookahead: bool = False,
    ) -> Future[VerifyResult]:
        """Score ``tree`` after the session's pending token and commit what acceptance keeps.

        ``draft_ns``: how long the coordinator waited for the tree from its drafter (0: none asked); the
        session's next draft budget counts it (``draft_budget``). ``lookahead``: run the session's Jacobi
        lookahead rows in the step where ``--lookahead`` allows, and return their n-grams (they change nothing
        that is accepted).
        """
        try:
            tree.validate(self.vocab_size, self.limits.max_tree_nodes, self.limits.max_tree_depth)
            if token_masks is not None:
                token_masks.check(len(tree) + 1, self.vocab_size)
        except (InvalidTreeError, InvalidTokenMasksError) as exc:
            raise InvalidArgument(str(exc)) from exc
        if num_successors < 0:
            raise InvalidArgument(f"num_successors must be >= 0, got {num_successors}")
        call = VerifyCall(
            session_id,
            owner,
            num_committed=num_committed,
            tree=tree,
            num_successors=num_successors,
            return_features=return_features,
            token_masks=token_masks,
            forced_tokens=token_masks.forced_tokens(self.vocab_size) if token_masks is not None else None,
            draft_ns=max(0, draft_ns),
            lookahead=lookahead,
        )
        return self._submit(call)

    def score(self, session_id: str, tree: TokenTree) -> torch.Tensor:
        """The target's fp32 logits [len(tree) + 1, vocab] at the pending token and each node; commits nothing.

        The same forward rows that Verify's acceptance reads (for tests and numerics reports).
        """
        logits: torch.Tensor = self.submit_score(session_id, tree).result()
        return logits

    def submit_score(self, session_id: str, tree: TokenTree) -> Future[torch.Tensor]:
        session = self._sessions.peek(session_id)
        num_committed = len(session.committed) if session is not None else 0
        return self._submit(VerifyCall(session_id, num_committed=num_committed, tree=tree, score_only=True))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between steps: calls submitted meanwhile are served together afterwards."""
        with self._cond:
            self._paused = True
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.05))
        return True

    def release(self, session_id: str, owner: str = "") -> bool:
        released: bool = self._submit(ReleaseCall(session_id, owner)).result()
        return released

    @property
    def model_runner(self) -> ModelRunner:
        """The engine's forward (benchmarks switch its step forms)."""
        return self._runner

    @property
    def step_form(self) -> str:
        """How the engine's step runs: prepacked products and row buckets, or eager (``ModelRunner.describe``)."""
        return self._runner.describe()

    def profile_cost(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 5) -> CostCurve:
        """Measure this engine's cost curve on a scratch session and size draft budgets with it.

        Measured on the engine thread, between steps: the curve prices the engine's steps, and a thread with
        another OpenMP team or another torch thread count (the serving thread runs torch on one where the engine
        owns the cores) times other costs, flatter over rows than the steps it prices (docs/benchmarks.md,
        "The cost curve, timed where steps run").
        Five repeats a point rather than two: the curve sizes every tree this verifier checks, and two repeats
        leave its ratios noisy enough to mis-size them, for a few seconds more at start-up (docs/benchmarks.md,
        "Smaller figures behind rules in the code").
        """
        curve = self._on_engine_thread(lambda: self._measure_cost(sizes, repeats))
        self.use_cost_curve(curve)
        return curve

    def _measure_cost(self, sizes: tuple[int, ...], repeats: int) -> CostCurve:
        """``profile_cost``'s measurement, on the thread that calls it."""
        sizes = tuple(n for n in sizes if n <= self.limits.max_batch_tokens)
        context, long_context = PROFILE_CONTEXTS
        long_context = max(context, min(long_context, self.limits.max_session_tokens - max(sizes)))
        sizes_by_region = [long_context + max(sizes)] + [context + max(sizes)] * 7
        scratch = self._runner.new_arena(sum(n + 16 for n in sizes_by_region) + 16 * 8)
        regions = [scratch.allocate(n) for n in sizes_by_region]
        prompt = torch.randint(0, self.vocab_size, (context + max(sizes),), device=self.device)

        def run(sessions: int, tokens: int, cached: int = context) -> None:
            per = max(1, tokens // sessions)
            plan = StepPlan(scratch)
            ids, pos = [], []
            for i in range(sessions):
                region = regions[i]
                assert region is not None
                region.length = cached
                plan.segments.append(Segment.chunk(region, cached, slice(i * per, (i + 1) * per), self.device))
                ids.append(prompt[:per])
                pos.append(torch.arange(cached, cached + per, device=self.device))
            rows = torch.arange(sessions * per, device=self.device)
            self._runner.forward(plan, torch.cat(ids), torch.cat(pos), rows, rows[:0])

        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        for region in regions:  # fill the contexts once
            assert region is not None
            plan = StepPlan(scratch, [Segment.chunk(region, 0, slice(0, context), self.device)])
            self._runner.forward(plan, prompt[:context], torch.arange(context, device=self.device), empty, empty)
        first = regions[0]
        assert first is not None
        for cached in (*scratch.keys, *scratch.values):
            # The long context's other slots: zeros time as keys do (attention reads every one alike), where a
            # prefill of them would lengthen every start on a small CPU.
            cached[:, first.start + context : first.start + long_context].zero_()
        curve = measure_curve(run, sizes, repeats)
        if long_context > context:
            slope = measure_context_cost(
                lambda tokens, cached: run(1, tokens, cached),
                [n for n in sizes if n <= PROFILE_CONTEXT_MAX_ROWS],
                (context, long_context),
                repeats,
            )
            curve = replace(curve, context=context, per_row_context_s=slope)
        return curve

    def use_cost_curve(self, curve: CostCurve) -> None:
        """Size draft budgets with ``curve`` (measured by ``profile_cost``, now or on an earlier start)."""
        with self._cond:
            self._budget = DraftBudget(curve, self.limits.max_tree_nodes)
        ratios = ", ".join(f"{n}: {r:.2f}" for n, r in curve.ratios().items())
        log.info(
            "cost curve c(n)/c(1) {%s}; c(1) = %.1f ms over %d cached tokens, %.2f ms per extra session, "
            "%.2f ms per row per 1000 cached tokens more",
            ratios,
            curve.seconds[0] * 1e3,
            curve.context,
            curve.per_session_s * 1e3,
            curve.per_row_context_s * 1e6,
        )

    def close(self) -> None:
        """Stop the engine thread; queued calls fail with UNAVAILABLE."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def park(self) -> None:
        """End the engine thread once it has no work (waits for it); the next call starts a new one.

        For a process that holds several verifiers (the benchmarks' in-process modes): every thread that has
        computed keeps an OpenMP team, and with more team threads than CPUs libgomp puts every worker to sleep
        between parallel regions, which slows plain decoding by a quarter to a third (``target_service.engine_threads``;
        docs/benchmarks.md, "One OpenMP team by default"). A thread's team ends with it, so parked verifiers cost
        the running one nothing. A service holds one verifier and never parks it.
        """
        with self._cond:
            if self._stopping or self._parked:
                return
            self._parking = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _check_tokens(self, token_ids: list[int], what: str) -> None:
        array = np.asarray(token_ids, dtype=np.int64)
        bad = np.flatnonzero((array < 0) | (array >= self.vocab_size))
        if bad.size:
            token = int(array[bad[0]])
            raise InvalidArgument(f"{what} id {token} is outside the vocabulary [0, {self.vocab_size})")

    def _submit(self, call: Call) -> Future[Any]:
        with self._cond:
            if self._stopping:
                raise Unavailable("the verifier is shutting down; retry on another replica")
            call.enqueued_ns = self._clock()
            self._queue.append(call)
            self._wake()
        return call.future

    def _on_engine_thread(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the engine thread between two steps and return what it returns (or raise what it
        raised). What it times is then what the engine's steps cost: the thread's OpenMP team, its torch threads
        (the serving thread runs torch on one where the engine owns the cores), its step forms."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                raise Unavailable("the verifier is shutting down; retry on another replica")
            self._tasks.append((work, future))
            self._wake()
        return future.result()

    def _wake(self) -> None:
        """Tell the engine thread there is work, starting a new one if it was parked (under ``_cond``)."""
        self._cond.notify()
        if self._parked:
            self._parked = False
            self._thread = threading.Thread(target=self._resume, name="verifier-engine", daemon=True)
            self._thread.start()

    # ---- the engine thread ----

    def _engine(self) -> None:
        """The engine thread: its torch threads, the step prepared (on the thread that will run it), the loop."""
        try:
            compute_on_this_thread(self._engine_threads)
            self._prepare_steps()
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        self._loop()

    def _resume(self) -> None:
        """A parked verifier's new engine thread: the step was prepared by the first."""
        compute_on_this_thread(self._engine_threads)
        self._loop()

    def _prepare_steps(self) -> None:
        """Capture (CUDA graphs) or compile (inductor) the step's shapes now, not in a request's round."""
        if not (self._runner.captures_steps or self._runner.compiles_steps):
            return
        started = self._clock()
        shapes = self._runner.prepare_steps(self._arena, self.limits.max_batch_tokens, self.limits.max_session_tokens)
        took = (self._clock() - started) / 1e9
        if self._runner.captures_steps:
            log.info("captured %d step shapes as CUDA graphs in %.1f s", shapes, took)
        else:
            log.info("compiled the step with inductor in %.1f s", took)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while (not (self._queue or self._tasks) or self._paused) and not self._stopping:
                    if self._parking and not self._queue and not self._tasks:
                        self._parking, self._parked = False, True
                        return
                    self._cond.wait(timeout=5.0)
                    if not self._paused:
                        self._sessions.expire()
                if self._stopping:
                    pending = list(self._queue)
                    self._queue.clear()
                    tasks = list(self._tasks)
                    self._tasks.clear()
                    break
                self._busy = True
                task = self._tasks.popleft() if self._tasks else None
            if task is not None:
                work, done = task
                try:
                    done.set_result(work())
                except BaseException as exc:  # the caller raises it; the engine goes on
                    done.set_exception(exc)
                continue
            try:
                if not self._step():
                    with self._cond:  # everything waits for memory: nap until a call arrives or a moment passes
                        self._cond.wait(timeout=0.01)
            except Exception as exc:  # a bug must not kill the engine nor leave callers waiting
                log.exception("engine step failed")
                for call in self._step_calls:
                    if not call.future.done():
                        self._abandon(call, Unavailable(f"the verifier failed this step ({type(exc).__name__}); retry"))
        for call in pending:
            fail(call, Unavailable("the verifier is shutting down; retry on another replica"))
        for _, done in tasks:
            done.set_exception(Unavailable("the verifier is shutting down"))

    def _step(self) -> bool:
        """Run one step; False when there was nothing it could run."""
        work = self._take_work()
        if not work.verifies and not work.prefills:
            return False
        started = self._clock()
        queued: list[tuple[str, float]] = []
        for call in [c for c, _ in work.verifies] + [c for c, _ in work.prefills]:
            if not call.started_ns:
                call.started_ns = started
                queued.append(
                    ("verify" if isinstance(call, VerifyCall) else "prefill", (started - call.enqueued_ns) / 1e9)
                )
        inputs = step_inputs.pack(work, self._arena, self.device)
        out = self._runner.forward(
            inputs.plan,
            inputs.input_ids,
            inputs.positions,
            inputs.score_rows,
            inputs.feature_rows,
            inputs.layer_rows,
            inputs.layers,
        )
        self._num_steps += 1
        sessions = len(work.verifies)
        self._recent_sessions = max(float(sessions), 0.5 * self._recent_sessions + 0.5 * sessions)
        load = round(self._recent_sessions)
        budget = self._budget.nodes_for(load) if self._guard.arm_now else 0  # the engine-wide figure, for the log
        num_segments, num_tokens = len(inputs.plan.segments), int(inputs.input_ids.numel())
        self._activity.add(num_segments, num_tokens, self._clock() - started, budget)
        ngrams: dict[str, tuple[tuple[int, ...], ...]] = {}
        lookahead_rows = 0
        for call, _, logits in step_inputs.lookahead_rows(work, out):
            window = call.window
            assert window is not None
            lookahead_rows += window.rows
            ngrams[call.session_id] = tuple(window.advance(logits.argmax(dim=-1).tolist()))
        committed: dict[str, int] = {}
        for call, session, logits, hidden in step_inputs.verify_rows(work, out):
            found = ngrams.get(call.session_id, ())
            committed[call.session_id] = self._finish_verify(call, session, logits, hidden, load, sessions, found)
        for prefill, tokens, hidden in step_inputs.prefill_rows(work, out):
            if hidden is not None:
                prefill.features.append(hidden)
            self._advance_prefill(prefill, tokens)
        ended = self._clock()
        step_s = (ended - started) / 1e9
        for waiting in work.behind:
            # It could not run before its session's call ended: its queue time (and its answer's verify_ns, and the
            # KV cache's admission wait) count from here, so a round sent ahead does not look like a queue.
            if not waiting.started_ns:
                waiting.enqueued_ns = ended
        self._guard.observe(committed, step_s)
        if len(work.verifies) == 1 and not work.prefills and not lookahead_rows:
            call, _ = work.verifies[0]
            self._budget.observe_step(num_tokens, call.num_committed, step_s)  # the curve learns what steps cost
        yielded = sum(len(found) for found in ngrams.values())
        step = EngineStep(num_segments, num_tokens, tuple(queued), lookahead_rows, yielded, step_s)
        for observer in self._step_observers:
            observer(step)
        return True

    def _take_work(self) -> StepWork:
        """Pick this step's calls under the token and session budgets; answer releases and stale calls.

        Verify calls go first, in arrival order, so running streams are never
        held up by new prompts; prefill chunks take what is left of the token
        budget (a prompt always advances by at least one small chunk). One
        call per session per step; the others stay queued in order.
        """
        work = StepWork()
        tokens_left = self.limits.max_batch_tokens
        seen: set[str] = set()
        stepping: set[str] = set()  # sessions whose Verify is in this step: never evicted to make room
        deferred: list[Call] = []
        prefills: list[PrefillCall] = []
        with self._cond:
            self._sessions.expire()
            queued = list(self._queue)
            self._queue.clear()
        self._in_step = {call.session_id for call in queued}
        self._step_calls = queued
        for call in queued:
            if call.future.cancelled():
                self._abandon(call, None)
            elif call.future.done():  # a prefill whose last chunk completed it in the previous step
                continue
            elif call.session_id in seen:
                deferred.append(call)
                work.behind.append(call)
            elif not self._owned_by_caller(call):
                pass  # answered PermissionDenied
            elif isinstance(call, ReleaseCall):
                resolve(call, self._sessions.release(call.session_id))
            elif isinstance(call, PrefillCall):
                prefills.append(call)
            elif isinstance(call, VerifyCall):
                if len(work.verifies) >= self.limits.max_batch_sessions or call.num_tokens > tokens_left:
                    deferred.append(call)
                elif (session := self._session_for(call)) is not None:
                    if self._sessions.reserve(session.region, len(session.committed) + len(call.tree), stepping):
                        work.verifies.append((call, session))
                        stepping.add(call.session_id)
                        tokens_left -= call.num_tokens
                    else:
                        self._wait_or_fail(call, deferred)
            seen.add(call.session_id)
        for prefill in prefills:
            if tokens_left <= 0 and (work.prefills or work.verifies):
                deferred.append(prefill)
            elif prefill.session is None and not self._start_prefill(prefill):
                self._wait_or_fail(prefill, deferred)
            elif prefill.remaining == 0:
                self._complete_prefill(prefill)
            else:
                chunk = min(prefill.remaining, max(tokens_left, 16))
                work.prefills.append((prefill, chunk))
                tokens_left -= chunk
                deferred.append(prefill)  # stays queued until its last chunk is done
        # Back in arrival order: the queue's own (``_submit`` appends under the lock), not the calls' stamps, which
        # tie under a clock that has not moved (a test's fake one) where arrival order still holds.
        arrival = {call: i for i, call in enumerate(queued)}
        deferred.sort(key=arrival.__getitem__)
        with self._cond:
            self._queue.extendleft(reversed(deferred))
        self._plan_lookahead(work, tokens_left)
        return work

    def _plan_lookahead(self, work: StepWork, tokens_left: int) -> None:
        """Give the step's Verify calls that ask for lookahead their sessions' windows, while the step has rows.

        Each window takes all its rows or none, in call order, within the token budget; under "auto" only
        while the cost curve says the step with them costs at most ``NEARLY_FREE`` times the step without
        (off on a CPU's curve, where every row costs).
        """
        if self._lookahead == "off":
            return
        rows = sum(call.num_tokens for call, _ in work.verifies) + sum(tokens for _, tokens in work.prefills)
        if self._lookahead == "auto" and not nearly_free(self._budget.curve, rows, self._lookahead_window):
            return  # not even a filling window's first level is free (a CPU's curve): no window is touched
        for call, session in work.verifies:
            if not call.lookahead or call.score_only:
                continue
            if session.lookahead is None:
                session.lookahead = LookaheadWindow(self._lookahead_window, self._lookahead_ngram - 1)
            window = session.lookahead
            window.follow(session.committed)
            extra = window.rows
            if extra > tokens_left or (self._lookahead == "auto" and not nearly_free(self._budget.curve, rows, extra)):
                continue
            if not self._window_fits(call, session, extra):
                continue
            call.window = window
            rows += extra
            tokens_left -= extra

    def _window_fits(self, call: VerifyCall, session: Session, extra: int) -> bool:
        """Whether ``extra`` window rows fit the session's context and cache (never evicting anyone for them), and
        keep the segment where its attention computes a row alike whatever shares it (``model_runner``)."""
        window = session.lookahead
        assert window is not None
        slots = len(session.committed) + len(call.tree) + extra
        furthest = len(session.committed) + window.width + window.num_levels  # the last guess's position + 1
        if max(slots, furthest) > self.limits.max_session_tokens:
            return False
        if call.num_tokens + extra > self._runner.max_invariant_segment_rows:
            return False
        return self._arena.reserve(session.region, slots, self.limits.max_session_tokens)

    def _owned_by_caller(self, call: Call) -> bool:
        """False (and the call answered PermissionDenied) when the session exists and another owner created it.

        A prefill in progress is not checked again: it was when it started.
        """
        if isinstance(call, PrefillCall) and call.session is not None:
            return True
        session = self._sessions.peek(call.session_id)
        if session is None or session.owner == call.owner:
            return True
        fail(call, PermissionDenied(f"session {call.session_id!r} belongs to another caller or tenant"))
        return False

    def _session_for(self, call: VerifyCall) -> Session | None:
        """The call's session if it is there and in step; otherwise the call is answered with the error."""
        session = self._sessions.get(call.session_id)
        if session is None:
            fail(
                call,
                NotFound(f"unknown session {call.session_id!r} (never prefilled, released or evicted): prefill it"),
            )
            return None
        if call.num_committed != len(session.committed):
            fail(
                call,
                FailedPrecondition(
                    f"session {call.session_id!r} holds {len(session.committed)} committed tokens, "
                    f"the request says {call.num_committed}: prefill it again"
                ),
            )
            return None
        depth = max(call.tree.depths(), default=0)
        if len(session.committed) + depth + 1 > self.limits.max_session_tokens:
            fail(
                call,
                ResourceExhausted(
                    f"session {call.session_id!r} would exceed the context limit of "
                    f"{self.limits.max_session_tokens} tokens"
                ),
            )
            return None
        return session

    def _busy_sessions(self) -> set[str]:
        """Sessions with a call in the step being built or in the queue: never evicted."""
        with self._cond:
            return self._in_step | {call.session_id for call in self._queue}

    def _wait_or_fail(self, call: Call, deferred: list[Call]) -> None:
        waited = self._clock() - call.enqueued_ns
        if waited < self._admission_timeout_ns:
            deferred.append(call)
            return
        self._abandon(
            call,
            ResourceExhausted(
                f"the verifier's KV cache ({self._arena.capacity_bytes / 2**30:.2f} GiB) stayed full for "
                f"{waited / 1e9:.0f} s: retry later, or give the verifier more --kv-cache-gib or replicas"
            ),
        )

    def _start_prefill(self, call: PrefillCall) -> bool:
        # Where a kept cache's rows are copied, a prefill that returns features returns those of the rows it
        # computes: the last positions, as the drafter's head takes them (it starts there).
        call.session = self._sessions.start(call.session_id, call.tokens, call.sampling, call.owner)
        if call.session is not None:
            call.session.feature_layers = call.feature_layers
            call.cached_tokens = call.session.region.length
        return call.session is not None

    def _advance_prefill(self, call: PrefillCall, tokens: int) -> None:
        assert call.session is not None
        call.session.region.length += tokens
        if call.remaining == 0:
            self._complete_prefill(call)

    def _complete_prefill(self, call: PrefillCall) -> None:
        session = call.session
        assert session is not None
        if call.future.cancelled():
            self._abandon(call, None)
            return
        # Sessions in the step being run keep their memory: the forward writes into it.
        self._sessions.register(call.session_id, session, protected=self._in_step)
        features = None
        if call.return_features:
            rows = torch.cat(call.features) if call.features else torch.zeros(0, self.hidden_size)
            features = _float16(rows)
        call.features = []
        resolve(call, PrefillResult(self._clock() - call.enqueued_ns, features, call.cached_tokens))

    def _abandon(self, call: Call, error: SpecserveError | None) -> None:
        """Give up a call; a prefill in progress frees its memory."""
        if isinstance(call, PrefillCall) and call.session is not None:
            self._sessions.abandon(call.session_id, call.session)
            call.session = None
        if error is not None:
            fail(call, error)

    def _finish_verify(
        self,
        call: VerifyCall,
        session: Session,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        load: int,
        batch_sessions: int,
        lookahead_ngrams: tuple[tuple[int, ...], ...] = (),
    ) -> int:
        """Apply the call's acceptance and answer it with the session's next draft budget at ``load`` (and the
        n-grams its lookahead rows yielded).

        Returns the tokens it committed.
        """
        tree = call.tree
        if call.score_only:
            resolve(call, logits.clone())
            return 0
        if call.token_masks is not None:
            logits = masked_logits(logits, call.token_masks)
        try:
            acceptance = accept(tree, logits, session)
        except Exception:  # e.g. no probability mass left after top-k/top-p: this session only
            log.exception("sampling failed for session %s; releasing it", call.session_id)
            self._sessions.discard(call.session_id, session)
            fail(
                call,
                InvalidArgument(
                    f"session {call.session_id!r}: its sampling parameters left no token to sample; the session "
                    "was released (prefill again with other temperature/top_p/top_k)"
                ),
            )
            return 0
        accepted = commit(self._arena, session, tree, acceptance)
        self._budget.observe(max(tree.depths(), default=0), len(accepted))
        session.acceptance.observe(max(tree.depths(), default=0), len(accepted))
        session.acceptance.observe_draft(call.draft_ns / 1e9)
        budget = self._session_budget(session, load)
        k = min(call.num_successors, self.vocab_size)
        successors = logits.topk(k, dim=-1).indices.tolist() if k > 0 else []
        rows = [0, *(node + 1 for node in acceptance.path)]
        now = self._clock()
        resolve(
            call,
            VerifyResult(
                accepted_tokens=accepted,
                accepted_nodes=acceptance.path,
                bonus_token=acceptance.bonus_token,
                verify_ns=now - call.enqueued_ns,
                successors=successors,
                features=_float16(hidden[rows]) if hidden is not None else None,
                draft_budget_nodes=budget,
                batch_sessions=batch_sessions,
                queue_ns=call.started_ns - call.enqueued_ns,
                lookahead_ngrams=lookahead_ngrams,
            ),
        )
        return len(accepted) + 1

    def _session_budget(self, session: Session, load: int) -> int:
        """Draft nodes that pay for this session at ``load``, by its acceptance so far (this round's included)."""
        if not self._guard.arm_now:  # the guard's "off" arm is its own probe of "no drafts": no probes inside it
            return 0
        acceptance = session.acceptance
        alpha = acceptance.alpha(self._budget.alpha)
        by_cost = self._budget.nodes_for(load, alpha, acceptance.draft_s, session.region.length)
        return acceptance.budget(by_cost, self.limits.max_tree_nodes)


class _NeverProbe:
    """Budgets from the cost model alone (``throughput_guard=False``: tests, benchmarks of the model itself)."""

    arm_now = True

    def observe(self, committed: Mapping[str, int], step_s: float = 0.0) -> None:
        return None


class _ActivityLog:
    """Sums over engine steps, logged every ``every_s`` while the engine works: what an operator watches."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, every_s: float = 10.0) -> None:
        self._clock = clock
        self._every_ns = int(every_s * 1e9)
        self._since = clock()
        self._steps = self._segments = self._tokens = self._busy_ns = self._budget = 0

    def add(self, segments: int, tokens: int, step_ns: int, budget: int) -> None:
        self._steps += 1
        self._segments += segments
        self._tokens += tokens
        self._busy_ns += step_ns
        self._budget += budget
        now = self._clock()
        if now - self._since >= self._every_ns:
            n = self._steps
            log.info(
                "engine: %d steps in %.1f s (busy %.0f%%), %.1f sessions and %.1f tokens a step, "
                "%.1f ms a step, draft budget %.1f nodes",
                n,
                (now - self._since) / 1e9,
                100 * self._busy_ns / (now - self._since),
                self._segments / n,
                self._tokens / n,
                self._busy_ns / n / 1e6,
                self._budget / n,
            )
            self.__init__(self._clock, self._every_ns / 1e9)  # type: ignore[misc]


def _float16(rows: torch.Tensor) -> np.ndarray:
    return rows.detach().to("cpu", torch.float16).numpy()
