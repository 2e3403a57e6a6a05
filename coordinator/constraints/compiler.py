"""Constraints compiled into llguidance grammars: off the event loop, bounded, cached.

A compiled grammar is a pristine matcher; each request forks it (``deep_copy``,
microseconds). The cache key is (the constraint's hash, the vocabulary
fingerprint): a grammar's token masks depend on the vocabulary, and the
coordinator refuses workers with another one, so one process sees one
fingerprint, but the key stays right if that ever changes.

Compilation runs in its own small thread pool under a time limit, and
llguidance's parser limits bound its work and memory (lexer states, grammar
size, fuel per step). A constraint over a limit, or one llguidance refuses,
is an INVALID_ARGUMENT naming the problem in our words (``refusals``);
llguidance's whole text goes to the log only.

Each compiled grammar carries a floor on the tokens of any output that
completes it (``shortest``); ``check_room`` refuses a request whose token
limit is below it, since that request could only end cut and unmatched.

An observer (the coordinator's metrics) hears of each cache lookup, each
grammar built (its compile time) and each refusal (its reason).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance

from coordinator.constraints.grammar_state import GrammarState
from coordinator.constraints.refusals import ConstraintRefused, refused, timed_out, too_few_tokens
from coordinator.constraints.shortest import VocabularyBytes, shortest_output_tokens
from coordinator.constraints.spec import Constraint, ConstraintKind, ConstraintLimits

log = logging.getLogger(__name__)

# JSON is written compact, with json.dumps' separators: no free whitespace, so keys and punctuation are forced.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Bounds on what one constraint may cost to build and to follow (llguidance's defaults are 250k states, 500k
# symbols): a pathological regex or grammar fails with "over the limit" instead of eating the coordinator.
PARSER_LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, max_grammar_size=100_000)


class CompileObserver(Protocol):
    """What the compiler reports (coordinator.metrics.CoordinatorMetrics); ``kind`` is a ConstraintKind value."""

    def grammar_cache_lookup(self, hit: bool) -> None: ...

    def grammar_compiled(self, kind: str, seconds: float) -> None: ...

    def grammar_refused(self, kind: str, reason: str) -> None: ...


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint ready to follow: ``new_state()`` gives one request its own matcher."""

    constraint: Constraint
    template: llguidance.LLMatcher
    vocab_size: int
    eos_token_ids: frozenset[int]
    compile_ns: int  # building the grammar and its matcher (not llguidance's one-off tokenizer set-up)
    min_tokens: int = 0  # no output completes it in fewer tokens (a floor: ``shortest``)

    def new_state(self) -> GrammarState:
        return GrammarState(self.template.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarCompiler:
    """Compiles constraints for one vocabulary; ``await compile(c)`` from the event loop."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        vocab_fingerprint: str,
        limits: ConstraintLimits | None = None,
        cache_size: int = 256,
        workers: int = 2,
        observer: CompileObserver | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._fingerprint = vocab_fingerprint
        self.limits = limits or ConstraintLimits()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._vocab_bytes: VocabularyBytes | None = None
        self._tokenizer_lock = threading.Lock()
        self._observer = observer

    def _ll_tokenizer(self) -> tuple[llguidance.LLTokenizer, VocabularyBytes]:
        """llguidance's view of the vocabulary and each token's bytes, built once (about 0.3 s) on first use, in
        a worker thread."""
        with self._tokenizer_lock:
            if self._tokenizer is None or self._vocab_bytes is None:
                backend = self._hf_tokenizer.backend_tokenizer
                self._tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
                )
                self._vocab_bytes = VocabularyBytes(self._tokenizer, self._vocab_size)
            return self._tokenizer, self._vocab_bytes

    async def warm(self) -> None:
        """Build the tokenizer ahead of the first constrained request."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._ll_tokenizer)

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, from the cache or built now; InvalidArgument when it cannot be."""
        constraint.check(self.limits)
        key = (constraint.digest, self._fingerprint)
        cached = self._cache.get(key)
        if self._observer is not None:
            self._observer.grammar_cache_lookup(cached is not None)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        loop = asyncio.get_running_loop()
        kind = constraint.kind.value
        try:
            async with asyncio.timeout(self.limits.compile_timeout_s):
                compiled = await loop.run_in_executor(self._pool, self._compile, constraint)
        except TimeoutError as exc:
            refusal = timed_out(constraint, self.limits.compile_timeout_s)
            self._refused(kind, refusal)
            raise refusal from exc
        except ConstraintRefused as refusal:
            self._refused(kind, refusal)
            raise
        if self._observer is not None:
            self._observer.grammar_compiled(kind, compiled.compile_ns / 1e9)
        self._cache[key] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def check_room(self, grammar: CompiledGrammar, max_new_tokens: int) -> None:
        """Refuse a request whose token limit is below the constraint's shortest output: it could never complete
        (a request that passes may still be cut; its stats then say ``constraint_complete`` false)."""
        if max_new_tokens < grammar.min_tokens:
            refusal = too_few_tokens(grammar.constraint, grammar.min_tokens, max_new_tokens)
            self._refused(grammar.constraint.kind.value, refusal)
            raise refusal

    def _refused(self, kind: str, refusal: ConstraintRefused) -> None:
        if self._observer is not None:
            self._observer.grammar_refused(kind, refusal.reason)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        tokenizer, vocab_bytes = self._ll_tokenizer()
        started = time.perf_counter_ns()
        grammar = _grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=PARSER_LIMITS
        )
        if is_error:
            raise refused(constraint, messages[0] if messages else "")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if template.is_error():
            raise refused(constraint, template.get_error())
        min_tokens = shortest_output_tokens(template, tokenizer, vocab_bytes)
        return CompiledGrammar(
            constraint, template, self._vocab_size, frozenset(self._eos), time.perf_counter_ns() - started, min_tokens
        )


def _grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet checked)."""
    match constraint.kind:
        case ConstraintKind.JSON_SCHEMA:
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise ConstraintRefused("json_schema must be a JSON object", "other", detail=str(exc)) from exc
        case ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.text)
        case ConstraintKind.LARK_GRAMMAR:
            return llguidance.LLMatcher.grammar_from_lark(constraint.text)
        case ConstraintKind.CHOICE:
            # Lark string literals take JSON's escapes: each choice is one literal, matched exactly.
            return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices)
