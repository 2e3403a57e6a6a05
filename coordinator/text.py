"""Turning committed tokens into streamed text: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Emit text for tokens one round at a time without broken UTF-8 or lost spaces.

    A token's text can depend on its neighbours (a byte-level BPE token may
    hold half a UTF-8 character; some tokenizers drop a leading space at the
    start of a decode). So each step decodes a short window that starts a few
    tokens back and emits only what the new tokens added, holding text back
    while it ends in an incomplete character (the same offsets scheme as TGI
    and vLLM).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def push(self, token_id: int) -> str:
        """Add one token; returns the new complete text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Cut the text stream before the first stop string.

    Text that could be the start of a stop string is held back until the next
    text shows whether it is; ``feed`` returns what is safe to emit.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self._held + text
        cut = min((index for stop in self._stops if (index := text.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._longest_partial_stop(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
