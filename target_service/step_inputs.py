"""One engine step's forward: every call's tokens packed into one ragged batch, and the rows read back.

A Verify feeds its session's pending token followed by its tree's nodes, at
the positions of their depths, with a mask that lets each node see the cached
context, the pending token and its own ancestors; every one of its rows is
scored, except a row whose token mask (structured output) allows one token:
the head is the priciest product of a row, and that row can only pick its
token. A Verify may also carry its session's lookahead window (``lookahead``):
Jacobi rows after the tree, in the same segment, that see the context, the
pending token and their own window, and that no tree row sees; their scored
rows come after every tree's. A prefill chunk feeds the next tokens of its
prompt, causally. The
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
from target_service.layer_features import session_rows, union_of
from target_service.lookahead import window_mask, with_window
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
    layer_rows: torch.Tensor | None = None  # rows of sessions that name feature layers (``layer_features``)
    layers: tuple[int, ...] = ()  # every layer those sessions name


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
    layered: list[int] = []  # feature rows of sessions that name layers
    windows: list[int] = []  # the lookahead windows' scored rows, after every tree's
    for call, session in work.verifies:
        start = len(ids)
        cached = len(session.committed) - 1
        ids.append(session.committed[-1])
        ids.extend(call.tree.token_ids)
        n = call.num_tokens
        depths = torch.tensor([0, *call.tree.depths()], dtype=torch.long)
        positions.append(cached + depths)
        mask = tree_mask(call.tree.parents, depths, cached) if len(call.tree) else None
        window = call.window
        rows = n
        if window is not None:  # Jacobi rows after the tree, in its segment; no tree row sees them
            ids.extend(window.tokens())
            positions.append(cached + window.offsets())
            mask = with_window(mask, cached, n, window_mask(len(window.levels), window.width))
            windows.extend(start + n + row for row in window.scored_rows())
            rows += window.rows
        mask = mask.to(device) if mask is not None else None
        plan.segments.append(Segment(session.region, cached, slice(start, start + rows), mask))
        score.extend(start + row for row in call.head_rows)
        if call.return_features:
            (layered if session.feature_layers else feature).extend(range(start, start + n))
    for prefill, tokens in work.prefills:
        assert prefill.session is not None
        start = len(ids)
        done = prefill.session.region.length
        ids.extend(prefill.tokens[done : done + tokens])
        positions.append(torch.arange(done, done + tokens))
        plan.segments.append(Segment.chunk(prefill.session.region, done, slice(start, start + tokens), device))
        if prefill.return_features:
            (layered if prefill.feature_layers else feature).extend(range(start, start + tokens))
    return StepInputs(
        plan,
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.cat(positions).to(device),
        torch.tensor(score + windows, dtype=torch.long, device=device),
        torch.tensor(feature, dtype=torch.long, device=device),
        torch.tensor(layered, dtype=torch.long, device=device) if layered else None,
        union_of(_named_layers(work)) if layered else (),
    )


def _named_layers(work: StepWork) -> list[tuple[int, ...]]:
    """The feature layers of each call in ``work`` that asked for features."""
    named = [session.feature_layers for call, session in work.verifies if call.return_features]
    return named + [prefill.feature_layers for prefill, _ in work.prefills if prefill.return_features]


def verify_rows(
    work: StepWork, out: StepOutput
) -> Iterator[tuple[VerifyCall, Session, torch.Tensor, torch.Tensor | None]]:
    """Each Verify with its rows' logits and, where it asked, hidden states (the order ``pack`` laid them)."""
    score_at = feature_at = layered_at = 0
    for call, session in work.verifies:
        n = call.num_tokens
        scored = len(call.head_rows)
        logits = out.logits[score_at : score_at + scored]
        score_at += scored
        if call.forced_tokens is not None and scored < n:
            logits = with_forced_rows(logits, call.forced_tokens)
        hidden = None
        if call.return_features and session.feature_layers:
            hidden = _layered(out, layered_at, n, session.feature_layers)
            layered_at += n
        elif call.return_features:
            hidden = out.features[feature_at : feature_at + n]
            feature_at += n
        yield call, session, logits, hidden


def _layered(out: StepOutput, at: int, n: int, layers: tuple[int, ...]) -> torch.Tensor:
    """Rows [at, at + n) of the step's layer features, a session's ``layers`` concatenated per row."""
    assert out.layer_features is not None, "the step kept no layers"
    stacked = out.layer_features[at : at + n]
    return session_rows(stacked, out.layer_union, layers)


def lookahead_rows(work: StepWork, out: StepOutput) -> Iterator[tuple[VerifyCall, Session, torch.Tensor]]:
    """Each Verify that ran a lookahead window, with its scored rows' logits (the window's last level)."""
    at = sum(len(call.head_rows) for call, _ in work.verifies)
    for call, session in work.verifies:
        if call.window is not None:
            width = call.window.width
            yield call, session, out.logits[at : at + width]
            at += width


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
    asked = [(call, session) for call, session in work.verifies if call.return_features]
    feature_at = sum(call.num_tokens for call, session in asked if not session.feature_layers)
    layered_at = sum(call.num_tokens for call, session in asked if session.feature_layers)
    for prefill, tokens in work.prefills:
        hidden = None
        if prefill.return_features and prefill.feature_layers:
            hidden = _layered(out, layered_at, tokens, prefill.feature_layers)
            layered_at += tokens
        elif prefill.return_features:
            hidden = out.features[feature_at : feature_at + tokens]
            feature_at += tokens
        yield prefill, tokens, hidden
