"""How few tokens any output that completes a constraint can take: a lower bound, cheap enough to check per request.

A request whose ``max_new_tokens`` is below that bound can only end cut by the token limit with text that does
not match, so it is refused up front (``refusals.too_few_tokens``) instead of spending the verifier's time.

The bound is the constraint's forced opening: the bytes llguidance says every output starts with (a schema's
``{"name": "``, a one-string choice's whole string), written in as few tokens as any tokenization of them takes
(llguidance's masks allow the tokenizer's own there, which is never shorter), plus one token when the constraint
is not yet complete after them. It stops at the first real choice, so it is exact for fixed strings
and a floor for everything else: a request it passes may still be cut (``GenerationStats.constraint_complete``
then says so), but one it refuses could never have completed.
"""

from __future__ import annotations

import bisect

import llguidance

MAX_FORCED_BYTES = 4096  # the forced opening is counted this far (a floor still: the rest only adds tokens)


class VocabularyBytes:
    """The bytes of every ordinary token (special ones write none), to count how few tokens write a byte string."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        pieces = {tokenizer.decode_bytes([t]) for t in range(vocab_size) if not tokenizer.is_special_token(t)}
        pieces.discard(b"")
        self._pieces = pieces
        self._sorted = sorted(pieces)
        self._lengths = sorted({len(p) for p in pieces})

    def fewest_tokens(self, data: bytes) -> tuple[int | None, int | None]:
        """The fewest tokens that write ``data`` exactly, and the fewest whose last token reaches past its end
        (into bytes still to be chosen); None where no tokens can."""
        # fewest[i]: the fewest tokens that write exactly data[:i] (None: none can)
        fewest: list[int | None] = [0] + [None] * len(data)
        past: int | None = None
        for start in range(len(data)):
            before = fewest[start]
            if before is None:
                continue
            count = before + 1
            if (past is None or count < past) and self._extends(data[start:]):  # one token: the rest and more
                past = count
            for length in self._lengths:
                end = start + length
                if end > len(data):
                    break
                now = fewest[end]
                if (now is None or count < now) and data[start:end] in self._pieces:
                    fewest[end] = count
        return fewest[-1], past

    def _extends(self, prefix: bytes) -> bool:
        """Some token's bytes are ``prefix`` followed by at least one more byte."""
        at = bisect.bisect_right(self._sorted, prefix)
        return at < len(self._sorted) and self._sorted[at].startswith(prefix)


def shortest_output_tokens(
    template: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, vocab: VocabularyBytes
) -> int:
    """A floor on the tokens of any output that completes the constraint (EOS not counted)."""
    matcher = template.deep_copy()
    forced = matcher.compute_ff_bytes()
    if not forced:
        return 0 if matcher.is_accepting() else 1
    whole = len(forced) <= MAX_FORCED_BYTES
    forced = forced[:MAX_FORCED_BYTES]
    exact, past = vocab.fewest_tokens(forced)
    if exact is not None and whole:
        # Complete right after the forced bytes, or at least one more token to go? (Unknown counts as complete.)
        tokens = tokenizer.tokenize_bytes(forced)
        if matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_accepting():
            exact += 1
    counts = [c for c in (exact, past) if c is not None]
    return min(counts) if counts else 1  # no tokens write them: not this floor's to judge
