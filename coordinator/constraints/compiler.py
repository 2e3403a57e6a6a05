"""Constraints compiled into llguidance grammars: off the event loop, bounded, cached.

A compiled grammar is a pristine matcher; each request forks it (``deep_copy``,
microseconds). The cache key is (the constraint's hash, the vocabulary
fingerprint): a grammar's token masks depend on the vocabulary, and the
coordinator refuses workers with another one, so one process sees one
fingerprint, but the key stays right if that ever changes.

Compilation runs in its own small thread pool under a time limit, and
llguidance's parser limits bound its work and memory (lexer states, grammar
size, fuel per step). A constraint over a limit, or one llguidance refuses,
is an INVALID_ARGUMENT naming the problem in a line; llguidance's whole text
goes to the log only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance

from coordinator.constraints.grammar_state import GrammarState
from coordinator.constraints.spec import Constraint, ConstraintKind, ConstraintLimits
from specserve.errors import InvalidArgument

log = logging.getLogger(__name__)

# JSON is written compact, with json.dumps' separators: no free whitespace, so keys and punctuation are forced.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Bounds on what one constraint may cost to build and to follow (llguidance's defaults are 250k states, 500k
# symbols): a pathological regex or grammar fails with "over the limit" instead of eating the coordinator.
PARSER_LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, max_grammar_size=100_000)

_LOCATION = re.compile(r"^at \d+\(\d+\): ")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint ready to follow: ``new_state()`` gives one request its own matcher."""

    constraint: Constraint
    template: llguidance.LLMatcher
    vocab_size: int
    eos_token_ids: frozenset[int]
    compile_ns: int

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
        self._tokenizer_lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built once (about 0.3 s) on first use, in a worker thread."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                backend = self._hf_tokenizer.backend_tokenizer
                self._tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    async def warm(self) -> None:
        """Build the tokenizer ahead of the first constrained request."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._ll_tokenizer)

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, from the cache or built now; InvalidArgument when it cannot be."""
        constraint.check(self.limits)
        key = (constraint.digest, self._fingerprint)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.compile_timeout_s):
                compiled = await loop.run_in_executor(self._pool, self._compile, constraint)
        except TimeoutError as exc:
            raise InvalidArgument(
                f"{constraint.kind.value} took longer than {self.limits.compile_timeout_s:g} s to compile; simplify it"
            ) from exc
        self._cache[key] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        started = time.perf_counter_ns()
        tokenizer = self._ll_tokenizer()
        grammar = _grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=PARSER_LIMITS
        )
        if is_error:
            raise _refused(constraint, messages[0] if messages else "")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if template.is_error():
            raise _refused(constraint, template.get_error())
        return CompiledGrammar(
            constraint, template, self._vocab_size, frozenset(self._eos), time.perf_counter_ns() - started
        )


def _grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet checked)."""
    match constraint.kind:
        case ConstraintKind.JSON_SCHEMA:
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise InvalidArgument("json_schema must be a JSON object", detail=str(exc)) from exc
        case ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.text)
        case ConstraintKind.LARK_GRAMMAR:
            return llguidance.LLMatcher.grammar_from_lark(constraint.text)
        case ConstraintKind.CHOICE:
            # Lark string literals take JSON's escapes: each choice is one literal, matched exactly.
            return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices)


def _refused(constraint: Constraint, message: str) -> InvalidArgument:
    """INVALID_ARGUMENT with the first line of llguidance's reason (it names the problem in the caller's own
    constraint: "Unknown format: weird", "invalid regex"), cleaned and cut short; the whole text to the log."""
    first = _LOCATION.sub("", message.strip().splitlines()[0] if message.strip() else "")
    first = _CONTROL.sub(" ", first)[:200] or "it is not supported"
    if "limit" in message.lower() or "too many" in message.lower():
        first = f"it is over the size limit ({first})"
    return InvalidArgument(f"{constraint.kind.value} could not be compiled: {first}", detail=message)
