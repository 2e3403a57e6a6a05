"""The coordinator's calls of the verifier as values: a session's Prefill, and a Verify of its tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree


@dataclass(frozen=True)
class SessionPrefill:
    """Create (or replace) the verifier session ``session_id`` holding ``token_ids``.

    One value instead of a long argument list, as VerifyCall: the round loop builds it and the router, the gRPC
    client and the in-process adapter pass it on as it is, so an option is added in one place. Tuples, not
    lists, so that the value cannot change under a call that holds it. Not target_service's ``PrefillCall``:
    that is the engine's queue entry for a prefill (its future, owner and progress), private to that tier.
    """

    session_id: str
    # The session's tokens: all but the last are cached; the last is pending (the root of its next Verify).
    token_ids: tuple[int, ...]
    sampling: SamplingParams  # the session's, seed included: its Verifies sample with it
    return_features: bool = False  # also the target's features at the cached positions
    # The target layers whose inputs, concatenated per row, are the session's features here and in its Verifies
    # (empty: the final hidden state); the verifier keeps them with the session.
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyCall:
    """Verify ``tree`` on top of the ``num_committed`` tokens the coordinator has committed for ``session_id``.

    One value instead of a long argument list: the round loop builds it once and the router, the gRPC
    clients (unary and stream) and the in-process adapter pass it on as it is, so an option is added in one
    place. A count that differs from the verifier's fails with FAILED_PRECONDITION (the session is re-prefilled).
    """

    session_id: str
    num_committed: int
    tree: TokenTree = field(default_factory=TokenTree)  # may be empty: a plain round
    # > 0: also the target's that many likeliest next tokens at each scored position (Token Recycling).
    num_successors: int = 0
    return_features: bool = False  # also the target's hidden states at the committed positions it scored
    # Structured output: the tokens the target may pick at each scored row (None: every token).
    token_masks: TokenMasks | None = None
    # How long the drafter took to send ``tree`` (0: none was asked); the session's draft budget counts it.
    draft_ns: int = 0
    # Also Jacobi lookahead rows for the session where the verifier's --lookahead allows, and their n-grams back
    # (``VerifyResult.lookahead_ngrams``); they never change what is accepted.
    lookahead: bool = False
