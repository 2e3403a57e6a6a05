"""One Verify as a value: what the coordinator asks the verifier to do with a session's tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree


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
