"""Drafting past what a constraint forces: the coordinator sends the forced tokens ahead, the drafter drafts after.

Under a structured-output constraint a round often starts where the grammar leaves one token, then another (a
schema's next key and its punctuation). The coordinator adds those tokens to the tree itself; told them first
(``DraftFeedback.forced_prefix``), the drafter starts its tree with them and drafts what follows, where the free
text is, instead of drafting from before them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.constraints.grammar_state import GrammarState
from coordinator.constraints.spec import Constraint, ConstraintKind
from draft_service.drafter import DraftSession
from specserve.results import DraftFeedback
from specserve.token_tree import ROOT
from specserve.v1 import drafter_pb2
from specserve.wire import feedback_from_proto, feedback_to_proto
from tests.conftest import run_generation
from tests.unit.test_drain import first_refusal
from tests.unit.test_structured_output import WatchedDrafter, compiled, repeating_generation
from tests.unit.test_work_ahead import PROMPT, lookup_drafter, work_all_ahead


def stats_of(session: DraftSession) -> dict[tuple[str, int], list[float]]:
    return dict(session._builder.stats._counts)


def test_the_tree_starts_with_the_prefix_and_the_draft_is_what_follows_it() -> None:
    """Prompt lookup drafts what followed "1 2" in the prompt (3 4 5 6 7); told 3 and 4 are forced, it drafts
    after "1 2 3 4" (5 6 7 ...) under them. A drafter asked from "... 1 2 3 4" itself drafts the same part."""
    told = lookup_drafter().open_session("s", PROMPT, "fp")
    reply = told.propose(DraftFeedback(forced_prefix=(3, 4)), max_nodes=5)
    assert reply.tree.token_ids[:2] == (3, 4) and reply.tree.parents[:2] == (ROOT, 0)
    alone = lookup_drafter().open_session("s", [*PROMPT, 3, 4], "fp")
    direct = alone.propose(DraftFeedback(), max_nodes=3).tree
    assert reply.tree.token_ids[2:] == direct.token_ids == (5, 6, 7)
    assert reply.tree.parents[2:] == tuple(1 if p == ROOT else p + 2 for p in direct.parents)


def test_the_sources_are_credited_at_their_own_depths_not_for_the_prefix() -> None:
    told = lookup_drafter().open_session("s", PROMPT, "fp")
    told.propose(DraftFeedback(forced_prefix=(3, 4)), max_nodes=5)
    alone = lookup_drafter().open_session("s", [*PROMPT, 3, 4], "fp")
    alone.propose(DraftFeedback(), max_nodes=3)
    # The verifier takes the prefix and 5 6 (nodes 0-3 of the told tree, 0-1 of the other), then its bonus 9.
    told.propose(DraftFeedback((3, 4, 5, 6, 9), accepted_node_indices=(0, 1, 2, 3)), max_nodes=0)
    alone.propose(DraftFeedback((5, 6, 9), accepted_node_indices=(0, 1)), max_nodes=0)
    assert stats_of(told) == stats_of(alone) != {}


def test_a_round_cut_inside_the_prefix_teaches_nothing() -> None:
    session = lookup_drafter().open_session("s", PROMPT, "fp")
    session.propose(DraftFeedback(forced_prefix=(3, 4)), max_nodes=5)
    session.propose(DraftFeedback((3,), accepted_node_indices=(0,)), max_nodes=0)  # max_new_tokens reached
    assert stats_of(session) == {}


def test_a_prefix_that_fills_the_tree_is_the_whole_tree() -> None:
    session = lookup_drafter().open_session("s", PROMPT, "fp")
    assert session.propose(DraftFeedback(forced_prefix=(3, 4)), max_nodes=2).tree.token_ids == (3, 4)


@pytest.mark.parametrize(("forced", "hit"), [(8, True), (9, False)])
def test_a_predraft_is_used_under_the_prefix_only_where_it_drafted_the_prefix(forced: int, hit: bool) -> None:
    """Pre-drafted for "3 4 5 6 accepted, bonus 7": prompt lookup's 8 1 2 3 after it. The round then starts
    with a forced 8 (the pre-draft drafted it: its 1 2 3 follow under the prefix) or a forced 9 (it did not)."""
    drafter = lookup_drafter()
    session = drafter.open_session("s", PROMPT, "fp")
    session.propose(DraftFeedback(), max_nodes=4)
    work_all_ahead(session)
    assert set(session._predrafts) == {(3, 4, 5, 6, 7)}
    report = DraftFeedback((3, 4, 5, 6, 7), accepted_node_indices=(0, 1, 2, 3), forced_prefix=(forced,))
    reply = session.propose(report, max_nodes=4)
    assert reply.predrafted is hit and drafter.predraft_counts.used == int(hit)
    assert reply.tree.token_ids[0] == forced
    if hit:
        assert reply.tree.token_ids == (8, 1, 2, 3) and reply.tree.parents == (ROOT, 0, 1, 2)


def test_the_prefix_crosses_the_wire() -> None:
    feedback = DraftFeedback((1, 2), accepted_node_indices=(0,), forced_prefix=(5, 6, 7))
    assert feedback_from_proto(feedback_to_proto(feedback, 8, None), None) == feedback


@pytest.mark.parametrize(
    ("prefix", "max_nodes", "problem"),
    [
        ([3, 4, 5], 2, "propose.forced_prefix: 3 tokens, more than the 2 nodes the tree may have"),
        ([3, -1], 4, "propose.forced_prefix: token id -1 outside the vocabulary"),
    ],
)
def test_a_prefix_the_tree_cannot_hold_or_outside_the_vocabulary_is_invalid_argument(
    prefix: list[int], max_nodes: int, problem: str
) -> None:
    propose = drafter_pb2.ProposeTree(max_nodes=max_nodes, forced_prefix=prefix)
    refused = asyncio.run(first_refusal(drafter_pb2.DraftRequest(propose=propose)))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (refused.details() or "")


def test_forced_next_is_the_chain_the_grammar_forces_and_leaves_the_state_where_it_was() -> None:
    grammar = compiled(Constraint(ConstraintKind.LARK_GRAMMAR, 'start: "[" item ",xy," item "]"\nitem: /[abc]{1,4}/'))
    state: GrammarState = grammar.new_state()
    assert state.forced_next(8) == ()  # "[" or "[a": not forced
    state.commit([14, 6])  # "[a,": then "x" "y" "," are forced, an item follows
    before = state.row().copy()
    assert state.forced_next(8) == (10, 11, 6)
    assert state.forced_next(2) == (10, 11) and state.forced_next(0) == ()
    assert state.row().tobytes() == before.tobytes()
    state.commit([10, 11, 6, 1, 5])  # "xy,a]": complete, only EOS left
    assert state.forced_next(8) == ()  # an EOS ends generation: nothing to draft after it


def test_drafting_past_forced_tokens_keeps_the_output_and_accepts_more_drafted_tokens() -> None:
    """Items repeat in this grammar's output and ",xy," is forced after each: drafting after ",xy," is where
    prompt lookup finds the next item. The output is the same either way; only the rounds change."""
    drafted_accepted = {}
    for blind in (True, False):
        generation, reference = repeating_generation(WatchedDrafter(tell=True, sees_prefix=not blind))
        tokens, _, stats = run_generation(generation)
        assert tokens == reference
        assert stats.drafter_error == ""
        drafted_accepted[blind] = stats.num_accepted_tokens - stats.num_forced_tokens
    assert drafted_accepted[False] > drafted_accepted[True]
