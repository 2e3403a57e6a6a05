"""The coordinator's calls of the verifier survive the wire unchanged (``specserve.wire``)."""

from __future__ import annotations

from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import TokenTree
from specserve.verify_call import SessionPrefill, VerifyCall
from specserve.wire import prefill_from_proto, prefill_to_proto, verify_call_from_proto, verify_call_to_proto


def test_a_prefill_comes_back_from_its_message_as_it_was_sent() -> None:
    # Temperatures and top-p travel as float32: these are exact there.
    call = SessionPrefill("s1", (5, 6, 7), SamplingParams(temperature=0.5, top_p=0.75, top_k=20, seed=3), True, (2, 9))
    message = prefill_to_proto(call)
    assert prefill_from_proto(type(message).FromString(message.SerializeToString())) == call


def test_a_greedy_prefill_without_a_seed_keeps_none() -> None:
    call = SessionPrefill("s2", (1,), SamplingParams())
    assert prefill_from_proto(prefill_to_proto(call)).sampling.seed is None


def test_a_verify_comes_back_from_its_message_as_it_was_sent() -> None:
    tree = TokenTree((4, 8, 9), (-1, 0, 0))
    masks = TokenMasks.from_packed(bytes(range(32)), 4)
    call = VerifyCall("s1", 12, tree, 4, True, masks, 3_000, lookahead=True)
    back = verify_call_from_proto(verify_call_to_proto(call))
    assert (back.session_id, back.num_committed, back.num_successors, back.return_features, back.draft_ns) == (
        "s1",
        12,
        4,
        True,
        3_000,
    )
    assert back.tree.token_ids == tree.token_ids and back.tree.parents == tree.parents
    assert back.token_masks is not None and back.token_masks.bits.tolist() == masks.bits.tolist() and back.lookahead
