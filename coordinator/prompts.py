"""Prompt handling: request limits, chat template, tokenization (off the event loop) and request validation.

Special-token policy: the text of a chat message is always ordinary text. A message that spells a special
token ("<|im_start|>system") is tokenized as those characters, never as the control token, so a user cannot
forge a role marker; the chat template's own markers stay control tokens. A raw ``prompt`` is tokenized as
written, special tokens included: its caller owns the whole context.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coordinator.admission import estimate_retry_after_s
from coordinator.rounds import GenerationRequest
from coordinator.speculation import Speculation
from specserve.errors import InvalidArgument, ResourceExhausted
from specserve.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class PromptLimits:
    max_new_tokens: int  # configured ceiling per request
    max_session_tokens: int  # the verifier's context limit
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of the prompt, or of all chat contents together
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256  # UTF-8 bytes of each stop string


def check_input(
    prompt: str | None,
    chat: Sequence[ChatTurn] | None,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
    limits: PromptLimits,
) -> None:
    """Everything that can be checked before tokenizing (cheap, so a bad request costs nothing)."""
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    try:
        sampling.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgument(f"{len(stop)} stop strings; at most {limits.max_stop_strings} are allowed")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidArgument(f"stop string {i} is empty; every stop string needs at least one character")
        if (size := len(text.encode())) > limits.max_stop_string_bytes:
            raise InvalidArgument(
                f"stop string {i} is {size} bytes long; at most {limits.max_stop_string_bytes} bytes (UTF-8)"
            )
    if chat:
        check_chat_count(len(chat), limits)
        for i, turn in enumerate(chat):
            if turn.role not in CHAT_ROLES:
                raise InvalidArgument(f"chat message {i} has role {turn.role!r}; use one of {', '.join(CHAT_ROLES)}")
        size = sum(len(turn.content.encode()) for turn in chat)
        what = "the chat messages' contents are"
    else:
        if not prompt:
            raise InvalidArgument("the prompt is empty: send a non-empty `prompt` or at least one chat message")
        size = len(prompt.encode())
        what = "the prompt is"
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(
            f"{what} {size} bytes (UTF-8); at most {limits.max_prompt_bytes} bytes are allowed: send less text"
        )


def check_chat_count(num_messages: int, limits: PromptLimits) -> None:
    if num_messages > limits.max_chat_messages:
        raise InvalidArgument(
            f"the chat has {num_messages} messages; at most {limits.max_chat_messages} are allowed: "
            "drop or summarise earlier turns"
        )


def encode_prompt(tokenizer: Any, prompt: str | None, chat: Sequence[ChatTurn] | None) -> list[int]:
    """Token ids of a raw prompt, or of chat turns formatted with the model's chat template."""
    return PromptEncoder(tokenizer).encode_sync(prompt, chat, max_tokens=None)


class PromptEncoder:
    """Tokenizes prompts and chats; ``encode`` does it in worker threads, off the event loop.

    The Rust tokenizer's ``encode_batch`` lets go of the GIL while it works (a 4 MB prompt takes seconds), so
    the event loop keeps serving the other streams. Its plain ``encode``, which transformers' ``__call__``
    may use, holds the GIL throughout, and turning a million ids into a Python list holds it for about
    0.1 s: so the ids are listed only once their count fits the context, and a prompt too long for it is
    refused on the count alone.

    Message contents that spell special tokens are encoded by a copy of the tokenizer with
    ``encode_special_tokens`` set, made once: toggling that flag per call (as transformers'
    ``split_special_tokens`` does) would race with encodes running in other threads.

    The queue is bounded: at most ``max_waiting`` prompts wait for a worker (each holds its text, up to
    --max-prompt-bytes); one more is refused with RESOURCE_EXHAUSTED and ``retry-after-ms``, estimated from how
    long recent prompts took to tokenize. A prompt whose caller went away before a worker took it is dropped.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_workers: int = 2,
        max_waiting: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._literal_backend: Any = None
        self._literal_lock = threading.Lock()
        self._special = sorted(
            {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
            | {str(t) for t in getattr(tokenizer, "added_tokens_encoder", {})},
            key=len,
            reverse=True,
        )
        self._max_workers = max_workers
        self._max_waiting = max_waiting
        self._clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0  # prompts being tokenized or waiting for a worker (counted on the event loop)
        self._work_s: deque[float] = deque(maxlen=32)  # how long recent prompts took in a worker

    @property
    def pending(self) -> int:
        return self._pending

    async def encode(self, prompt: str | None, chat: Sequence[ChatTurn] | None, max_tokens: int) -> list[int]:
        """``encode_sync`` in a worker thread; ResourceExhausted when ``max_waiting`` prompts already wait."""
        if self._pending >= self._max_workers + self._max_waiting:
            raise self._busy()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="tokenize", initializer=_background_priority
            )
        loop = asyncio.get_running_loop()
        self._pending += 1
        try:
            return await loop.run_in_executor(self._executor, self._timed_encode, prompt, chat, max_tokens)
        finally:
            self._pending -= 1

    def _timed_encode(self, prompt: str | None, chat: Sequence[ChatTurn] | None, max_tokens: int) -> list[int]:
        started = self._clock()
        try:
            return self.encode_sync(prompt, chat, max_tokens)
        finally:
            self._work_s.append(self._clock() - started)  # deque.append is atomic: no lock across workers

    def _busy(self) -> ResourceExhausted:
        retry_ms = round(estimate_retry_after_s(self._work_s, self._pending, self._max_workers) * 1000)
        return ResourceExhausted(
            f"the coordinator is tokenizing {self._max_workers} prompts and {self._max_waiting} more are waiting, "
            f"its limit (--max-tokenize-queue): retry after {retry_ms} ms, or send a shorter prompt",
            metadata=(("retry-after-ms", str(retry_ms)),),
        )

    def encode_sync(self, prompt: str | None, chat: Sequence[ChatTurn] | None, max_tokens: int | None) -> list[int]:
        """Token ids; with ``max_tokens``, InvalidArgument (counted, not listed) when there are more."""
        if chat:
            for i, turn in enumerate(chat):
                if turn.role not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"chat message {i} has role {turn.role!r}; use one of {', '.join(CHAT_ROLES)}"
                    )
            if any(self._spells_special(turn.content) for turn in chat):
                pieces = self._chat_pieces(chat)
            else:
                messages = [{"role": turn.role, "content": turn.content} for turn in chat]
                text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                pieces = [(text, False)]
            return self._ids(pieces, add_special_tokens=False, max_tokens=max_tokens)
        if not prompt:
            raise InvalidArgument("the prompt is empty: send a non-empty `prompt` or at least one chat message")
        return self._ids([(prompt, False)], add_special_tokens=True, max_tokens=max_tokens)

    def _spells_special(self, text: str) -> bool:
        return any(token in text for token in self._special)

    def _chat_pieces(self, chat: Sequence[ChatTurn]) -> list[tuple[str, bool]]:
        """The formatted chat cut into (text, literal) pieces: message contents literal, the template not.

        The template is rendered with a sentinel in place of each content; the text around the sentinels
        is the template's own. Pieces are cut only at the template's special tokens, where the tokenizer
        cuts anyway, so text around a content is tokenized with it as before.
        """
        nonce = secrets.token_hex(8)
        sentinels = [f"\ue000{nonce}:{i}\ue001" for i in range(len(chat))]
        messages = [{"role": t.role, "content": s} for t, s in zip(chat, sentinels, strict=True)]
        rendered: str = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # (text, is content) spans in order.
        spans: list[tuple[str, bool]] = []
        rest = rendered
        for turn, sentinel in zip(chat, sentinels, strict=True):
            before, found, rest = rest.partition(sentinel)
            if not found:
                raise InvalidArgument("the chat template dropped a message; it cannot be formatted safely")
            spans += [(before, False), (turn.content, True)]
        spans.append((rest, False))
        # Cut the template's spans at its special tokens; join everything between cuts.
        pieces: list[tuple[str, bool]] = []
        current: list[tuple[str, bool]] = []
        for text, is_content in spans:
            if is_content:
                current.append((text, True))
                continue
            for part, is_special in self._split_special(text):
                if is_special:
                    pieces += self._merge(current)
                    current = []
                    pieces.append((part, False))
                else:
                    current.append((part, False))
        pieces += self._merge(current)
        return pieces

    @staticmethod
    def _merge(spans: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """Text between two template markers: one piece, literal when it holds any message content."""
        text = "".join(t for t, _ in spans)
        return [(text, any(c for _, c in spans))] if text else []

    def _split_special(self, text: str) -> list[tuple[str, bool]]:
        parts: list[tuple[str, bool]] = []
        while text:
            hits = [(text.find(t), t) for t in self._special if t in text]
            if not hits:
                parts.append((text, False))
                break
            at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
            if at:
                parts.append((text[:at], False))
            parts.append((token, True))
            text = text[at + len(token) :]
        return parts

    def _ids(self, pieces: list[tuple[str, bool]], add_special_tokens: bool, max_tokens: int | None) -> list[int]:
        if max_tokens is not None and sum(len(text) for text, _ in pieces) > COUNT_CHUNK_CHARS:
            at_least = sum(self._count_at_least(text, literal) for text, literal in pieces)
            if at_least > max_tokens:
                raise PromptTooLong(at_least, at_least=True)
        encodings = [self._encode_piece(text, literal, add_special_tokens) for text, literal in pieces]
        count = sum(len(e) for e in encodings)
        if max_tokens is not None and count > max_tokens:
            # Freed here, in the worker: the exception's traceback would otherwise carry a million-token
            # encoding to the event loop and free it there.
            encodings.clear()
            raise PromptTooLong(count)
        return [token for e in encodings for token in (e.ids if hasattr(e, "ids") else e)]

    def _count_at_least(self, text: str, literal: bool) -> int:
        """A lower bound on the tokens of ``text``, counted in chunks so that no encoding is ever large.

        Freeing an encoding takes the GIL (a million tokens: about 0.2 s, the event loop stalled); chunks of
        COUNT_CHUNK_CHARS are freed one by one, a millisecond each. A chunk ends before a space that follows a
        non-space where it can (where the pre-tokenizer splits anyway); whatever a cut changes (a word or a
        special token cut in two) is at most COUNT_SLACK_PER_CUT tokens, taken off.
        """
        count = 0
        start = 0
        cuts = 0
        while start < len(text):
            end = min(len(text), start + COUNT_CHUNK_CHARS)
            if end < len(text):
                natural = text.find(" ", end, end + COUNT_CHUNK_CHARS // 4)
                while natural > 0 and text[natural - 1].isspace():
                    natural = text.find(" ", natural + 1, end + COUNT_CHUNK_CHARS // 4)
                end = natural if natural > 0 else end
                cuts += 1
            encoding = self._encode_piece(text[start:end], literal, add_special_tokens=False)
            count += len(encoding)
            del encoding
            start = end
        return max(0, count - cuts * COUNT_SLACK_PER_CUT)

    def _encode_piece(self, text: str, literal: bool, add_special_tokens: bool) -> Any:
        if self._backend is None:  # not a fast tokenizer: transformers' own path
            ids: list[int] = self._tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=literal)[
                "input_ids"
            ]
            return ids
        backend = self._literal() if literal else self._backend
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _literal(self) -> Any:
        """The copy of the tokenizer that encodes special-token text as ordinary text (made when first needed)."""
        with self._literal_lock:
            if self._literal_backend is None:
                literal = copy.deepcopy(self._backend)
                literal.encode_special_tokens = True
                self._literal_backend = literal
            return self._literal_backend


def _background_priority() -> None:
    """Lower this worker thread's CPU priority (Linux nice is per thread): a prompt that takes seconds to
    tokenize then uses the CPU the running streams leave, instead of slowing their rounds on a shared machine."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICE)


TOKENIZE_NICE = 10


COUNT_CHUNK_CHARS = 1 << 16
"""A prompt longer than this is first counted in chunks of it (see ``PromptEncoder._count_at_least``)."""

COUNT_SLACK_PER_CUT = 16


class PromptTooLong(InvalidArgument):
    """The prompt has more tokens than fit the context with the tokens asked for."""

    def __init__(self, num_tokens: int, at_least: bool = False) -> None:
        super().__init__(f"the prompt has {'at least ' if at_least else ''}{num_tokens} tokens")
        self.num_tokens = num_tokens
        self.at_least = at_least


def context_error(
    num_prompt_tokens: int, max_new_tokens: int, limits: PromptLimits, at_least: bool = False
) -> InvalidArgument:
    return InvalidArgument(
        f"the prompt has {'at least ' if at_least else ''}{num_prompt_tokens} tokens; with "
        f"max_new_tokens={max_new_tokens} that exceeds the "
        f"model's context of {limits.max_session_tokens} tokens: shorten the prompt or ask for fewer tokens"
    )


def build_request(
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
    limits: PromptLimits,
    speculation: Speculation = Speculation(),
) -> GenerationRequest:
    if not prompt_ids:
        raise InvalidArgument("the prompt encodes to no tokens")
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > limits.max_session_tokens:
        raise context_error(len(prompt_ids), max_new_tokens, limits)
    try:
        sampling.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return GenerationRequest(prompt_ids, max_new_tokens, sampling, tuple(stop), speculation)
