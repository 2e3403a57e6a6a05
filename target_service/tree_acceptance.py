"""Which path of a verified tree a session keeps, and keeping it.

Greedy: the longest path whose every node is the target's argmax after its
parent (ties go to the lowest id on every path), plus the target's own next
token. Sampled: the walk follows the child equal to the target's keyed draw
at each position (``keyed_noise``), with rejection sampling for the rest, so
the committed tokens are distributed exactly as the target's. The session's
cache then keeps the pending token and the accepted path; rejected branches
leave no trace.
"""

from __future__ import annotations

import torch

from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree
from target_service.acceptance import Acceptance, accept_greedy, accept_sampled
from target_service.kv_arena import KVArena
from target_service.session_cache import Session


def masked_logits(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """``logits`` [rows, vocab] with the tokens each row's mask forbids at -inf (a copy).

    Structured output: row r's mask is the grammar's after the committed tokens and row r's own path, so
    greedy takes the argmax of what the grammar allows there, and sampling (temperature, top-k, top-p and
    rejection sampling alike, all downstream of this) draws from p renormalised over it.
    """
    allowed = torch.from_numpy(masks.allowed(logits.shape[-1])).to(logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


def accept(tree: TokenTree, logits: torch.Tensor, session: Session) -> Acceptance:
    """The accepted path and bonus token for ``tree``, scored by ``logits`` [1 + len(tree), vocab] (fp32)."""
    if session.sampling.greedy:
        # torch.argmax returns the first maximum: ties go to the lowest id on every path.
        return accept_greedy(tree, logits.argmax(dim=-1).tolist())
    p = target_probs(logits, session.sampling).cpu()
    return accept_sampled(tree, p, PositionNoise(session.seed, first_position=len(session.committed)))


def commit(arena: KVArena, session: Session, tree: TokenTree, acceptance: Acceptance) -> list[int]:
    """Keep the accepted path in the session's cache and its committed tokens; returns the accepted tokens."""
    cached = len(session.committed) - 1
    arena.keep(session.region, cached, [0, *(node + 1 for node in acceptance.path)])
    accepted = [tree.token_ids[node] for node in acceptance.path]
    session.committed.extend([*accepted, acceptance.bonus_token])
    return accepted
