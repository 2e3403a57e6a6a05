"""Incremental detokenization (real SmolLM2 tokenizer) and stop strings."""

from typing import Any

import pytest

from coordinator.text import IncrementalDetokenizer, StopMatcher

SAMPLES = [
    "Hello world, this is a test.",
    "  leading spaces and   runs   of spaces",
    "Unicode: café, naïve, 東京, emoji 🌊🐚 and math ∑x²",
    "line one\nline two\n\n\tindented",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_concatenate_to_the_full_decode(smollm2_tokenizer: Any, text: str) -> None:
    tok = smollm2_tokenizer
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(token) for token in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in delta for delta in deltas)


def test_partial_utf8_is_held_back(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok("🌊", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tok, [])
    outputs = [detok.push(token) for token in ids]
    assert outputs[:-1] == [""] * (len(ids) - 1)
    assert outputs[-1] == "🌊"


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(piece) for piece in pieces)
    return out if matcher.stopped else out + matcher.flush()


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "stopped"),
    [
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["ab", "c##", "d"], ["##"], "abc", True),
        (["a#", "b"], ["##"], "a#b", False),  # a held-back prefix that did not complete
        (["x", "y"], [], "xy", False),
        (["one END two END"], ["END", "two"], "one ", True),
        (["abc"], ["c", "bc"], "a", True),  # earliest occurrence wins
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], expected: str, stopped: bool) -> None:
    matcher = StopMatcher(stops)
    assert feed_all(matcher, pieces) == expected
    assert matcher.stopped is stopped


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("ART") == "START"
