"""The decoding modes the benchmark compares, behind one ``Mode`` protocol.

Each mode turns a chat prompt into an ``Outcome``: the output tokens and the
time it took, measured the same way for all modes (wall clock from the
prompt's token ids to the last token; ``distributed`` starts from the request
on the wire, so it also pays the coordinator's chat template and tokenization,
well under a millisecond).

``baseline`` is plain decoding through specserve's own engine (the
verifier's step with prepacked weights, one token a forward): the bar every
speed-up is measured against. ``baseline-eager`` is the same with
``--compile off``, and ``hf-plain`` transformers' own eager loop: what the
engine's step gains over each.

Every mode runs the target in the run's dtype except ``baseline-fp32``, plain
decoding through the engine in float32: what bf16 costs or saves against the
dtype the project used to run in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import torch

from bench.inproc import InProcessDrafter, InProcessVerifier, verifier_info
from client.sdk import GenerationParams, SpecserveClient, Stats
from client.sdk import TextChunk as ClientChunk
from coordinator.config import CoordinatorConfig, prompt_limits, round_policy
from coordinator.prompts import build_request
from coordinator.rounds import FinishReason, Generation, GenerationStats, TextChunk
from draft_service.config import DrafterConfig
from draft_service.draft_head import DraftHead
from draft_service.drafter import ALL_SOURCES, NGRAM_SOURCES
from draft_service.main import build_drafter
from specserve.model_loading import default_cache_root
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.config import VerifierConfig
from target_service.cost_curve import flattened
from target_service.engine_threads import compute_on_this_thread
from target_service.kept_curve import kept_curve_path, size_budgets
from target_service.verifier import Verifier

from .decoding import Fp32Head, hf_generate, plain_decode
from .target import FLOAT32, model_dtype

T = TypeVar("T")

BASELINE = "baseline"  # plain decoding through the engine (--compile auto)
EAGER_BASELINE = "baseline-eager"  # plain decoding through the engine with --compile off
HF_PLAIN = "hf-plain"  # plain decoding in transformers' eager model (fp32 head, as the verifier's)
FP32_BASELINE = "baseline-fp32"  # plain decoding in float32, whatever the run's dtype
PLAIN_MODES = (BASELINE, EAGER_BASELINE, HF_PLAIN, FP32_BASELINE)
COMPARED_MODES = ("hf-pld", "inproc", "distributed")
# Draft sources alone or combined, in process: `inproc:prompt_lookup`, `inproc:draft_model`,
# `inproc:prompt_lookup+ngram_pool+token_recycling` (any `+`-joined set of sources) and so on.
SOURCE_MODES = (*(f"inproc:{source}" for source in ALL_SOURCES), "inproc:" + "+".join(NGRAM_SOURCES))
# The distributed mode with the drafter's pre-drafting off, and on: what drafting ahead adds, measured side by
# side (`distributed` itself runs the cluster's default: off where the drafter shares the verifier's CPUs).
NO_PREDRAFT = "distributed-no-predraft"
PREDRAFT = "distributed-predraft"
# The distributed mode with a unary Verify call per round (the coordinator's --verify-transport unary) instead of
# the VerifyStream: what the stream saves, measured side by side.
UNARY_VERIFY = "distributed-unary"
# The `distributed` cluster itself with every request's speculation off: plain decoding through the three
# processes, what a user who turns speculation off gets (same processes, same cores, only the requests differ).
SPECULATION_OFF = "distributed-off"
# Plain decoding through three processes of its own whose rounds take turns (the coordinator's --no-verify-ahead):
# against `distributed-off`, what sending plain rounds ahead saves, measured side by side.
OFF_IN_TURN = "distributed-off-in-turn"
MODES = (
    *PLAIN_MODES,
    *COMPARED_MODES,
    NO_PREDRAFT,
    PREDRAFT,
    UNARY_VERIFY,
    SPECULATION_OFF,
    OFF_IN_TURN,
    *SOURCE_MODES,
)


def default_modes(dtype: str) -> tuple[str, ...]:
    """``baseline``, ``baseline-eager``, ``hf-pld``, ``inproc``, ``distributed`` and ``distributed-off``; with
    ``baseline-fp32`` when ``dtype`` is not fp32."""
    extra = (FP32_BASELINE,) if dtype != FLOAT32 else ()
    return (BASELINE, EAGER_BASELINE, *extra, *COMPARED_MODES, SPECULATION_OFF)


def cluster_modes(names: Sequence[str]) -> list[str]:
    """The modes that start specserve's three processes (their verifier runs outside this one)."""
    return [name for name in names if name.startswith("distributed")]


def mode_sources(name: str) -> tuple[str, ...] | None:
    """The draft sources of an ``inproc:a+b`` mode name; None when it is not one (or names unknown sources)."""
    if not name.startswith("inproc:"):
        return None
    sources = tuple(name.removeprefix("inproc:").split("+"))
    return sources if sources and set(sources) <= set(ALL_SOURCES) else None


@dataclass(frozen=True)
class Prompt:
    text: str  # the user turn
    token_ids: list[int]  # the chat-formatted prompt, as the coordinator encodes it
    max_new_tokens: int
    sampling: SamplingParams
    chat: tuple[tuple[str, str], ...] = ()  # (role, content) turns of a conversation; empty: ``text`` alone

    def messages(self) -> tuple[tuple[str, str], ...]:
        """The chat a client sends for this prompt: its turns, or ``text`` as the one user turn."""
        return self.chat or (("user", self.text),)


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]  # output tokens, EOS excluded
    eos: bool  # ended at an EOS token
    wall_ns: int
    rounds: int  # target forwards that committed tokens (the baseline: one per token)
    draft_tokens: int | None = None  # proposed draft tokens; None: not observable in this mode
    accepted_tokens: int | None = None
    draft_ns: int | None = None  # None: this mode does not split its time
    verify_ns: int | None = None
    note: str = ""  # e.g. why a drafter was dropped
    drafter_trees: int | None = None  # rounds whose tree came from the drafter; None: not observable
    predraft_hits: int | None = None  # of those, trees the drafter had drafted ahead
    predraft_hidden_ns: int | None = None  # the drafting time of those trees (hidden behind verification)
    # The rounds' time by phase (coordinator.round_phases), summed over the rounds; None: not observable.
    round_phase_ns: dict[str, int] | None = None
    rounds_plain_by_cost: int | None = None  # rounds run plain because drafted rounds did not pay end to end


class Mode(Protocol):
    name: str
    learns: bool  # its drafts improve with traffic (n-gram pools): a warm-pool pass is worth running
    dtype: str  # what its target runs in

    def run(self, prompt: Prompt) -> Outcome: ...

    def reset(self) -> None:
        """Forget what earlier prompts taught (n-gram pools), e.g. after the warm-up."""
        ...

    def close(self) -> None: ...


def on_a_thread_of_its_own(threads: int, work: Callable[[], T]) -> T:
    """``work``'s result, computed on a new thread with ``threads`` torch threads (0: this thread's count) that
    ends before this returns: its OpenMP team ends with it, as a parked verifier's does (``Verifier.park``), so
    transformers' modes use every core and leave no second team behind to slow the engines' steps."""
    threads = threads or torch.get_num_threads()

    def compute() -> T:
        compute_on_this_thread(threads)
        return work()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-mode") as thread:
        return thread.submit(compute).result()


class EnginePlainMode:
    """Plain decoding through the verifier's engine: one forward per token, a tree of size zero each round.

    The same step, KV arena and acceptance code the speculative modes run, so a speed-up over it is what
    speculation adds and nothing else; ``compile`` is the verifier's flag.
    """

    learns = False

    def __init__(
        self,
        model: Any,
        fingerprint: str,
        eos_ids: frozenset[int],
        name: str,
        compile: str,
        weights: str = "dtype",
        threads: int = 0,
    ) -> None:
        """``threads``: the engine thread's torch threads (0: torch's count when it starts)."""
        self.name = name
        self.dtype = model_dtype(model)
        self._eos_ids = eos_ids
        config = VerifierConfig(
            compile=compile,
            weights=weights,
            profile_cost=False,
            throughput_guard=False,
            torch_threads=threads,
            kept_prefixes=0,  # each prompt prefilled whole, as in every mode (``bench.cluster.start_cluster``)
        )
        self._verifier = Verifier.from_config(model, fingerprint, config, profile=False)
        self._verifier.park()  # one engine thread (one OpenMP team) in the process at a time: Verifier.park

    def run(self, prompt: Prompt) -> Outcome:
        start = time.perf_counter_ns()
        committed = list(prompt.token_ids)
        tokens: list[int] = []
        eos = False
        verify_ns = self._verifier.prefill("plain", committed, prompt.sampling).prefill_ns
        empty = TokenTree()
        for _ in range(prompt.max_new_tokens):
            result = self._verifier.verify("plain", len(committed), empty)
            verify_ns += result.verify_ns
            if result.bonus_token in self._eos_ids:
                eos = True
                break
            committed.append(result.bonus_token)
            tokens.append(result.bonus_token)
        self._verifier.release("plain")
        wall_ns = time.perf_counter_ns() - start
        self._verifier.park()
        return Outcome(tokens, eos, wall_ns, len(tokens) + eos, 0, 0, draft_ns=0, verify_ns=verify_ns)

    def reset(self) -> None:
        return None

    def close(self) -> None:
        self._verifier.close()


class HfPlainMode:
    """Plain decoding in transformers' eager model: one target forward per token (fp32 head, as the verifier's)."""

    learns = False

    def __init__(self, model: Any, eos_ids: frozenset[int], name: str = HF_PLAIN, threads: int = 0) -> None:
        """``threads``: torch threads of the thread each prompt runs on (0: this thread's count)."""
        self.name = name
        self.dtype = model_dtype(model)
        self._model = model
        self._head = Fp32Head(model)
        self._eos_ids = eos_ids
        self._threads = threads

    def run(self, prompt: Prompt) -> Outcome:
        start = time.perf_counter_ns()
        decoded = on_a_thread_of_its_own(
            self._threads,
            lambda: plain_decode(
                self._model, prompt.token_ids, prompt.max_new_tokens, self._eos_ids, prompt.sampling, self._head
            ),
        )
        wall_ns = time.perf_counter_ns() - start
        return Outcome(
            decoded.tokens, decoded.eos, wall_ns, decoded.forwards, 0, 0, draft_ns=0, verify_ns=decoded.forward_ns
        )

    def reset(self) -> None:
        return None

    def close(self) -> None:
        return None


class HfPromptLookupMode:
    """transformers ``generate(prompt_lookup_num_tokens=...)``: what a user would pick instead."""

    name = "hf-pld"
    learns = False

    def __init__(self, model: Any, eos_ids: frozenset[int], num_tokens: int = 10, threads: int = 0) -> None:
        """``threads``: torch threads of the thread each prompt runs on (0: this thread's count)."""
        self.dtype = model_dtype(model)
        self._model = model
        self._eos_ids = eos_ids
        self._num_tokens = num_tokens
        self._threads = threads

    def run(self, prompt: Prompt) -> Outcome:
        start = time.perf_counter_ns()
        decoded = on_a_thread_of_its_own(
            self._threads,
            lambda: hf_generate(
                self._model,
                prompt.token_ids,
                prompt.max_new_tokens,
                self._eos_ids,
                prompt.sampling,
                prompt_lookup_num_tokens=self._num_tokens,
            ),
        )
        wall_ns = time.perf_counter_ns() - start
        # Every forward commits its accepted candidates and one token of its own.
        accepted = len(decoded.tokens) + decoded.eos - decoded.forwards
        return Outcome(decoded.tokens, decoded.eos, wall_ns, decoded.forwards, decoded.draft_tokens, accepted)

    def reset(self) -> None:
        return None

    def close(self) -> None:
        return None


def _outcome_from_stats(tokens: list[int], wall_ns: int, stats: GenerationStats) -> Outcome:
    return Outcome(
        tokens,
        stats.finish_reason is FinishReason.EOS,
        wall_ns,
        stats.num_rounds,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        draft_ns=stats.draft_ns,
        verify_ns=stats.verify_ns,
        note=stats.drafter_error,
        drafter_trees=stats.num_drafter_trees,
        predraft_hits=stats.num_predraft_hits,
        predraft_hidden_ns=stats.predraft_hidden_ns,
        round_phase_ns=stats.phase_ns,
        rounds_plain_by_cost=stats.num_rounds_plain_by_cost,
    )


class InProcessMode:
    """specserve's round loop, verifier and drafter in this process (no gRPC).

    Configured with the services' own defaults (VerifierConfig, DrafterConfig,
    CoordinatorConfig) so it runs what ``distributed`` runs, minus the network.
    The n-gram pool is the drafter's embedded in-memory pool. ``sources``
    restricts drafting to some sources (the mode is then named after them).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        fingerprint: str,
        eos_ids: frozenset[int],
        sources: tuple[str, ...] = DrafterConfig().sources,
        head: DraftHead | None = None,
        throughput_guard: bool = VerifierConfig().throughput_guard,
        flat_verify_cost: bool = False,
        weights: str = "dtype",
        compile: str = "auto",
        threads: int = 0,
        gate_drafting: bool = CoordinatorConfig().gate_drafting,
        drafter_config: DrafterConfig | None = None,
        kept_curve_as: str | None = None,
    ) -> None:
        """``flat_verify_cost``: size trees as if extra draft nodes cost nothing (``flattened``), not at the
        curve the verifier measures here; ``weights`` and ``compile``: the verifier's --weights and --compile;
        ``gate_drafting``: the coordinator's --gate-drafting; ``drafter_config``: the drafter's settings (its
        tree shape, ...) as the distributed drafter parses its --drafter-arg words, ``sources`` replacing its own;
        ``kept_curve_as``: the model's name in the model cache, where the verifier service keeps its cost curve:
        the curve is read from there (measured and kept where it is not), as the service does, so both size trees
        by one curve; None measures a curve for this mode alone."""
        self.name = "inproc" if sources == DrafterConfig().sources else "inproc:" + "+".join(sources)
        self.learns = True
        self._drafter_config = replace(drafter_config or DrafterConfig(), sources=sources)
        self._head = head
        # What runs the draft head's products (``DraftHead.products``), for reports; None without a head.
        self.head_products = head.products if head is not None else None
        config = VerifierConfig(
            throughput_guard=throughput_guard, weights=weights, compile=compile, torch_threads=threads, kept_prefixes=0
        )
        self._verifier = Verifier.from_config(model, fingerprint, config, profile=kept_curve_as is None)
        if kept_curve_as is not None and config.profile_cost:
            size_budgets(self._verifier, kept_curve_path(default_cache_root(), kept_curve_as, self._verifier, config))
        if flat_verify_cost:
            self._verifier.use_cost_curve(flattened(self._verifier.cost_curve))
        self.dtype = self._verifier.dtype  # the model's: the harness loaded it in the run's dtype
        info = verifier_info(self._verifier)
        self._policy = round_policy(CoordinatorConfig(gate_drafting=gate_drafting), info)
        self._limits = prompt_limits(CoordinatorConfig(), info)
        self._tokenizer = tokenizer
        self._fingerprint = fingerprint
        self._eos_ids = eos_ids
        self.verify_cost = info.verify_cost  # the verifier's measured curve, as a coordinator sends it
        self._drafter = InProcessDrafter(build_drafter(self._drafter_config, head)[0], verify_cost=self.verify_cost)
        self._loop = asyncio.Runner()
        self._verifier.park()  # one engine thread (one OpenMP team) in the process at a time: Verifier.park

    def run(self, prompt: Prompt) -> Outcome:
        try:
            return self._loop.run(self._generate(prompt))
        finally:
            self._verifier.park()

    async def _generate(self, prompt: Prompt) -> Outcome:
        start = time.perf_counter_ns()
        request = build_request(prompt.token_ids, prompt.max_new_tokens, prompt.sampling, (), self._limits)
        generation = Generation(
            request,
            InProcessVerifier(self._verifier),
            self._drafter,
            self._tokenizer,
            self._eos_ids,
            self._fingerprint,
            self._policy,
        )
        tokens: list[int] = []
        async for event in generation.stream():
            if isinstance(event, TextChunk):
                tokens.extend(event.token_ids)
        return _outcome_from_stats(tokens, time.perf_counter_ns() - start, generation.stats)

    def reset(self) -> None:
        self._drafter = InProcessDrafter(
            build_drafter(self._drafter_config, self._head)[0], verify_cost=self.verify_cost
        )

    def close(self) -> None:
        self._loop.close()
        self._verifier.close()


class DistributedMode:
    """The three specserve processes over gRPC on loopback, through the client SDK.

    ``dtype`` is what the verifier was started with (``--dtype``); the harness does not load this target.
    """

    learns = True

    def __init__(
        self,
        address: str,
        dtype: str,
        reset_pool: Callable[[], None] | None = None,
        name: str = "distributed",
        speculation: str = "auto",
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.speculation = speculation
        self._client = SpecserveClient(address, timeout_s=600.0)
        self._reset_pool = reset_pool

    def run(self, prompt: Prompt) -> Outcome:
        s = prompt.sampling
        params = GenerationParams(
            prompt.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed, speculation=self.speculation
        )
        tokens: list[int] = []
        stats: Stats | None = None
        start = time.perf_counter_ns()
        for event in self._client.generate_chat(prompt.messages(), params):
            if isinstance(event, ClientChunk):
                tokens.extend(event.token_ids)
            else:
                stats = event
        wall_ns = time.perf_counter_ns() - start
        if stats is None:
            raise RuntimeError("the coordinator ended the stream without stats")
        if stats.num_prompt_tokens != len(prompt.token_ids):
            raise RuntimeError(
                f"the coordinator encoded the prompt to {stats.num_prompt_tokens} tokens, the harness to "
                f"{len(prompt.token_ids)}: they must use the same model and chat template"
            )
        return Outcome(
            tokens,
            stats.finish_reason == "eos",
            wall_ns,
            stats.num_rounds,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            draft_ns=round(stats.draft_s * 1e9),
            verify_ns=round(stats.verify_s * 1e9),
            note=stats.drafter_error,
            drafter_trees=stats.num_drafter_trees,
            predraft_hits=stats.num_predraft_hits,
            predraft_hidden_ns=round(stats.predraft_hidden_s * 1e9),
            round_phase_ns={phase: round(s * 1e9) for phase, s in stats.round_phase_s.items()},
            rounds_plain_by_cost=stats.num_rounds_plain_by_cost,
        )

    def reset(self) -> None:
        if self._reset_pool is not None:
            self._reset_pool()

    def close(self) -> None:
        self._client.close()
