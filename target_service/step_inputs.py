"""One engine step's forward: every call's tokens packed into one ragged batch, and the rows read back.

A Verify feeds its session's pending token followed by its tree's nodes, at
the positions of their depths, with a mask that lets each node see the cached
context, the pending token and its own ancestors; every one of its rows is
scored, except a row whose token mask (structured output) allows one token:
the head is the priciest product of a row, and that row can only pick its
token. A prefill chunk feeds the next tokens of its prompt, causally. The
rows a head asked for (``return_features``) come back as hidden states.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specserve.tree_masks import ancestor_matrix
from target_service.engine_calls import PrefillCall, StepWork, VerifyCall
from target_service.kv_arena import KVArena
from target_service.model_runner import StepOutput
from target_service.ragged_attention import Segment, StepPlan
from target_service.session_cache import Session


@dataclass(frozen=True)
class StepInputs:
    plan: StepPlan
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    score_rows: torch.Tensor  # rows whose logits are read back
    feature_rows: torch.Tensor  # rows whose hidden states are read back


def tree_mask(tree_parents: tuple[int, ...], depths: torch.Tensor, cached: int) -> torch.Tensor:
    """[n, cached + n] bool for the pending token and n - 1 nodes: the context, the pending token, ancestors."""
    n = len(tree_parents) + 1
    allowed = torch.ones(n, cached + n, dtype=torch.bool)
    allowed[:, cached:] = False
    allowed[:, cached] = True
    parents = torch.tensor(tree_parents, dtype=torch.long)
    allowed[1:, cached + 1 :] = ancestor_matrix(parents, int(depths.max()))
    return allowed


def pack(work: StepWork, arena: KVArena, device: torch.device) -> StepInputs:
    """Every call's tokens in one forward: ids, positions, and the rows to score and to return."""
    plan = StepPlan(arena)
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    score: list[int] = []
    feature: list[int] = []
    for call, session in work.verifies:
        start = len(ids)
        cached = len(session.committed) - 1
        ids.append(session.committed[-1])
        ids.extend(call.tree.token_ids)
        n = call.num_tokens
        depths = torch.tensor([0, *call.tree.depths()], dtype=torch.long)
        positions.append(cached + depths)
        mask = tree_mask(call.tree.parents, depths, cached).to(device) if len(call.tree) else None
        plan.segments.append(Segment(session.region, cached, slice(start, start + n), mask))
        score.extend(start + row for row in call.head_rows)
        if call.return_features:
            feature.extend(range(start, start + n))
    for prefill, tokens in work.prefills:
        assert prefill.session is not None
        start = len(ids)
        done = prefill.session.region.length
        ids.extend(prefill.tokens[done : done + tokens])
        positions.append(torch.arange(done, done + tokens))
        plan.segments.append(Segment.chunk(prefill.session.region, done, slice(start, start + tokens), device))
        if prefill.return_features:
            feature.extend(range(start, start + tokens))
    return StepInputs(
        plan,
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.cat(positions).to(device),
        torch.tensor(score, dtype=torch.long, device=device),
        torch.tensor(feature, dtype=torch.long, device=device),
    )


def verify_rows(
    work: StepWork, out: StepOutput
) -> Iterator[tuple[VerifyCall, Session, torch.Tensor, torch.Tensor | None]]:
    """Each Verify with its rows' logits and, where it asked, hidden states (the order ``pack`` laid them)."""
    score_at = feature_at = 0
    for call, session in work.verifies:
        n = call.num_tokens
        scored = len(call.head_rows)
        logits = out.logits[score_at : score_at + scored]
        score_at += scored
        if call.forced_tokens is not None and scored < n:
            logits = with_forced_rows(logits, call.forced_tokens)
        hidden = out.features[feature_at : feature_at + n] if call.return_features else None
        feature_at += n if call.return_features else 0
        yield call, session, logits, hidden


def with_forced_rows(scored: torch.Tensor, forced: np.ndarray) -> torch.Tensor:
    """[len(forced), vocab] logits: the head's rows in order, and for each row with a forced token (``forced`` >=
    0) 0 at that token and -inf elsewhere, the row's masked logits whatever the head would have said."""
    full = scored.new_full((len(forced), scored.shape[-1]), float("-inf"))
    tokens = torch.from_numpy(forced).to(scored.device)
    by_head = tokens < 0
    full[by_head] = scored
    rows = torch.nonzero(~by_head).squeeze(1)
    full[rows, tokens[rows]] = 0.0
    return full


def prefill_rows(work: StepWork, out: StepOutput) -> Iterator[tuple[PrefillCall, int, torch.Tensor | None]]:
    """Each prefill chunk with its token count and, where it asked, its rows' hidden states."""
    feature_at = sum(call.num_tokens for call, _ in work.verifies if call.return_features)
    for prefill, tokens in work.prefills:
        hidden = None
        if prefill.return_features:
            hidden = out.features[feature_at : feature_at + tokens]
            feature_at += tokens
        yield prefill, tokens, hidden
