"""Per-request control of speculation: off, auto (the default), or auto under a cap of draft tokens per round.

Speculation never changes the output (verification is lossless), only how many target forwards it takes. A caller
turns it off for predictable per-token latency, or caps it when its own measurements say deep trees do not pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from specserve.errors import InvalidArgument


class SpeculationMode(Enum):
    AUTO = "auto"  # draft as many tokens as pay off: the server's limit and the verifier's load budget
    OFF = "off"  # no drafting: the drafter is not even opened, every round is one plain target forward


@dataclass(frozen=True)
class Speculation:
    mode: SpeculationMode = SpeculationMode.AUTO
    max_draft_tokens: int = 0  # cap per round under AUTO (at least 1); 0: the server's own limit

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 0:
            raise InvalidArgument(
                f"max_draft_tokens must be 0 (the server's limit) or more, got {self.max_draft_tokens}"
            )
        if self.mode is SpeculationMode.OFF and self.max_draft_tokens:
            raise InvalidArgument("speculation is off: max_draft_tokens must be 0 (or leave speculation on auto)")

    @classmethod
    def parse(cls, mode: str, max_draft_tokens: int = 0) -> Speculation:
        """From an API's text ("auto", "off"), with a message naming the choices otherwise."""
        try:
            parsed = SpeculationMode(mode)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in SpeculationMode)
            raise InvalidArgument(f"speculation mode must be one of {choices}, got {mode!r}") from None
        return cls(parsed, max_draft_tokens)

    def draft_limit(self, server_limit: int) -> int:
        """Most draft tokens per round for this request under the server's own limit."""
        if self.mode is SpeculationMode.OFF:
            return 0
        return min(server_limit, self.max_draft_tokens) if self.max_draft_tokens else server_limit
