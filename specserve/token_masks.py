"""Per-row token masks for structured output: which tokens the target may pick at each scored row of a tree.

The coordinator's grammar matcher writes one row per scored position of a
Verify: row 0 for the pending token (the next token after the committed
ones), row i + 1 for tree node i (the next token after that node's path).
Rows are packed bits, ``ceil(vocab / 32) * 4`` bytes each, token t allowed
when bit ``t % 8`` of byte ``t // 8`` is set: the layout llguidance and
xgrammar write (little-endian int32 words), so a matcher fills a row in place
and the verifier reads it without conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def row_bytes(vocab_size: int) -> int:
    """Bytes of one packed row for ``vocab_size`` tokens (whole 32-bit words)."""
    return (vocab_size + 31) // 32 * 4


class InvalidTokenMasksError(ValueError):
    """Masks that do not fit the tree or the vocabulary; the message names the problem."""


@dataclass(frozen=True)
class TokenMasks:
    """Packed allowed-token bits, uint8 ``[rows, row_bytes]``."""

    bits: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.bits.shape[0])

    @staticmethod
    def from_rows(rows: list[bytes] | list[np.ndarray]) -> TokenMasks:
        return TokenMasks(np.stack([np.frombuffer(bytes(r), dtype=np.uint8) for r in rows]))

    @staticmethod
    def from_packed(data: bytes, num_rows: int) -> TokenMasks:
        if num_rows <= 0 or len(data) % num_rows:
            raise InvalidTokenMasksError(f"{len(data)} bytes of token masks do not split into {num_rows} rows")
        return TokenMasks(np.frombuffer(data, dtype=np.uint8).reshape(num_rows, len(data) // num_rows))

    def packed(self) -> bytes:
        return np.ascontiguousarray(self.bits).tobytes()

    def allowed(self, vocab_size: int) -> np.ndarray:
        """bool ``[rows, vocab_size]``: True where the token is allowed."""
        return np.unpackbits(self.bits, axis=1, bitorder="little")[:, :vocab_size].astype(bool)

    def forced_tokens(self, vocab_size: int) -> np.ndarray:
        """int64 ``[rows]``: the one token a row allows, -1 where it allows more than one (or none).

        A row that allows one token needs no logits: greedy and sampling alike can only pick that token.
        """
        allowed = self.allowed(vocab_size)
        forced = np.where(allowed.sum(axis=1) == 1, allowed.argmax(axis=1), -1)
        return forced.astype(np.int64)

    def allows(self, row: int, token: int) -> bool:
        return bool(self.bits[row, token >> 3] >> (token & 7) & 1)

    def check(self, num_rows: int, vocab_size: int) -> None:
        """Raise InvalidTokenMasksError unless there are ``num_rows`` rows for ``vocab_size``, none empty."""
        if self.num_rows != num_rows:
            raise InvalidTokenMasksError(f"got {self.num_rows} token mask rows for {num_rows} scored rows")
        if self.bits.shape[1] != row_bytes(vocab_size):
            raise InvalidTokenMasksError(
                f"token mask rows hold {self.bits.shape[1]} bytes; a vocabulary of {vocab_size} needs "
                f"{row_bytes(vocab_size)}"
            )
        empty = np.flatnonzero(~self.allowed(vocab_size).any(axis=1))
        if empty.size:
            raise InvalidTokenMasksError(f"token mask row {int(empty[0])} allows no token")
