"""What callers put in the verifier's queue, and how the engine answers them.

Every public call of the verifier becomes one of these objects with a
Future; the engine thread takes them from the queue (``verifier``), serves
them in steps (``step_inputs``) and answers each through its Future, with a
result or with the caller's own error.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree
from target_service.lookahead import LookaheadWindow
from target_service.session_cache import Session


@dataclass(eq=False)
class Call:
    session_id: str
    owner: str = ""
    future: Future[Any] = field(default_factory=Future)
    # When the call was queued, on the verifier's clock: ``Verifier._submit`` stamps it, so every time the engine
    # measures from it (queue time, verify_ns, the admission timeout) reads one clock, a test's fake one included.
    enqueued_ns: int = 0
    started_ns: int = 0  # first step that served it


@dataclass(eq=False)
class PrefillCall(Call):
    tokens: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_features: bool = False
    feature_layers: tuple[int, ...] = ()  # the layers whose inputs are the session's features (empty: the last)
    session: Session | None = None  # built chunk by chunk, registered when complete
    cached_tokens: int = 0  # of the tokens to cache, those copied from a kept cache when it started
    features: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_to_cache(self) -> int:
        return len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        done = self.session.region.length if self.session is not None else 0
        return self.num_to_cache - done


@dataclass(eq=False)
class VerifyCall(Call):
    num_committed: int = 0
    tree: TokenTree = field(default_factory=TokenTree)
    num_successors: int = 0  # the target's likeliest next tokens returned per scored position
    return_features: bool = False
    score_only: bool = False  # answer the fp32 logits and leave the session as it was
    token_masks: TokenMasks | None = None  # structured output: allowed tokens per scored row (None: all)
    # Per row, the one token its mask allows (-1: more than one); those rows skip the head (None: none do).
    forced_tokens: np.ndarray | None = None
    draft_ns: int = 0  # what the coordinator waited for this tree from its drafter (0: none asked)
    lookahead: bool = False  # the caller asks for lookahead rows (run where the verifier's setting allows)
    window: LookaheadWindow | None = None  # the session's lookahead window when this step runs it

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.tree)

    @cached_property
    def head_rows(self) -> list[int]:
        """The rows whose logits the head computes: all but the forced ones."""
        if self.forced_tokens is None:
            return list(range(self.num_tokens))
        return [int(row) for row in np.flatnonzero(self.forced_tokens < 0)]


@dataclass(eq=False)
class ReleaseCall(Call):
    pass


@dataclass
class StepWork:
    """What one step serves: calls with the tokens each feeds into the forward."""

    verifies: list[tuple[VerifyCall, Session]] = field(default_factory=list)
    prefills: list[tuple[PrefillCall, int]] = field(default_factory=list)  # (call, tokens this step)
    # Calls that wait behind their own session's call in this step (a round sent ahead): runnable once it ends.
    behind: list[Call] = field(default_factory=list)


def resolve(call: Call, value: object) -> None:
    if not call.future.done() and call.future.set_running_or_notify_cancel():
        call.future.set_result(value)


def fail(call: Call, error: SpecserveError) -> None:
    if not call.future.done() and call.future.set_running_or_notify_cancel():
        call.future.set_exception(error)
