"""Protobuf <-> domain conversions shared by the services' gRPC edges."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from specserve.results import DraftFeedback, DraftReply, PrefillResult, VerifiedTree, VerifyResult
from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import DraftDistribution, TokenTree
from specserve.v1 import common_pb2, drafter_pb2, verifier_pb2
from specserve.verify_call import SessionPrefill, VerifyCall


def tree_to_proto(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(
        token_ids=tree.token_ids,
        parents=tree.parents,
        sampled=tree.sampled,
        distributions=[
            common_pb2.DraftDistribution(parent=d.parent, token_ids=d.token_ids, probs=d.probs)
            for d in tree.distributions
        ],
    )


def tree_from_proto(message: common_pb2.TokenTree) -> TokenTree:
    return TokenTree(
        tuple(message.token_ids),
        tuple(message.parents),
        tuple(message.sampled),
        tuple(DraftDistribution(d.parent, tuple(d.token_ids), tuple(d.probs)) for d in message.distributions),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
    )


def features_to_proto(features: np.ndarray | None) -> common_pb2.HiddenFeatures | None:
    if features is None:
        return None
    rows = np.ascontiguousarray(features, dtype="<f2")
    return common_pb2.HiddenFeatures(
        num_positions=rows.shape[0], hidden_size=rows.shape[1], float16_data=rows.tobytes()
    )


def features_from_proto(message: common_pb2.HiddenFeatures) -> np.ndarray | None:
    """float16 [num_positions, hidden_size]; None for an unset message; ValueError when sizes disagree."""
    if message.hidden_size <= 0:
        return None
    expected = message.num_positions * message.hidden_size * 2
    if message.num_positions < 0 or len(message.float16_data) != expected:
        raise ValueError(
            f"features say {message.num_positions} x {message.hidden_size} float16 values "
            f"({expected} bytes) but carry {len(message.float16_data)} bytes"
        )
    flat = np.frombuffer(message.float16_data, dtype="<f2")
    return flat.reshape(message.num_positions, message.hidden_size).astype(np.float16)


def split_features(features: np.ndarray, max_bytes: int) -> list[np.ndarray]:
    """``features`` [m, hidden] cut, in order, into row slices of at most ``max_bytes`` float16 bytes each.

    A row is never cut (a row wider than ``max_bytes`` is a slice of its own); no rows, no slices.
    """
    rows_per_slice = max(1, max_bytes // (2 * max(1, features.shape[1])))
    return [features[i : i + rows_per_slice] for i in range(0, features.shape[0], rows_per_slice)]


def cost_to_proto(cost: Mapping[int, float]) -> list[common_pb2.CostPoint]:
    """A verify cost curve (draft nodes -> relative cost) as ``CostPoint`` messages, by tree size."""
    return [common_pb2.CostPoint(nodes=n, relative_cost=c) for n, c in sorted(cost.items())]


def cost_from_proto(points: Iterable[common_pb2.CostPoint]) -> tuple[tuple[int, float], ...]:
    """(nodes, relative cost) pairs, as sent; checking them is the receiver's (``VerifyCost.from_points``)."""
    return tuple((int(p.nodes), float(p.relative_cost)) for p in points)


def masks_to_proto(masks: TokenMasks | None) -> verifier_pb2.TokenMasks | None:
    if masks is None:
        return None
    return verifier_pb2.TokenMasks(num_rows=masks.num_rows, packed_bits=masks.packed())


def masks_from_proto(message: verifier_pb2.TokenMasks) -> TokenMasks | None:
    """None when the request carries no masks; raises InvalidTokenMasksError when they do not split into rows."""
    if message.num_rows == 0 and not message.packed_bits:
        return None
    return TokenMasks.from_packed(message.packed_bits, message.num_rows)


def prefill_to_proto(call: SessionPrefill) -> verifier_pb2.PrefillRequest:
    return verifier_pb2.PrefillRequest(
        session_id=call.session_id,
        token_ids=call.token_ids,
        sampling=sampling_to_proto(call.sampling),
        return_features=call.return_features,
        feature_layers=call.feature_layers,
    )


def prefill_from_proto(message: verifier_pb2.PrefillRequest) -> SessionPrefill:
    return SessionPrefill(
        message.session_id,
        tuple(message.token_ids),
        sampling_from_proto(message.sampling),
        message.return_features,
        tuple(message.feature_layers),
    )


def verify_call_to_proto(call: VerifyCall) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(
        session_id=call.session_id,
        num_committed_tokens=call.num_committed,
        tree=tree_to_proto(call.tree),
        num_successors=call.num_successors,
        return_features=call.return_features,
        token_masks=masks_to_proto(call.token_masks),
        draft_micros=max(0, call.draft_ns) // 1000,
        lookahead=call.lookahead,
    )


def verify_call_from_proto(message: verifier_pb2.VerifyRequest) -> VerifyCall:
    """Raises InvalidTokenMasksError when the masks do not split into rows."""
    return VerifyCall(
        message.session_id,
        message.num_committed_tokens,
        tree_from_proto(message.tree),
        message.num_successors,
        message.return_features,
        masks_from_proto(message.token_masks),
        message.draft_micros * 1000,
        message.lookahead,
    )


def ngrams_to_proto(ngrams: Sequence[Sequence[int]]) -> common_pb2.NGrams | None:
    """n-grams of one size as an ``NGrams`` message (None for none); ValueError when their sizes differ."""
    if not ngrams:
        return None
    size = len(ngrams[0])
    if any(len(ngram) != size for ngram in ngrams):
        raise ValueError("an NGrams message holds n-grams of one size")
    return common_pb2.NGrams(size=size, token_ids=[token for ngram in ngrams for token in ngram])


def ngrams_from_proto(message: common_pb2.NGrams) -> tuple[tuple[int, ...], ...]:
    """The whole n-grams of an ``NGrams`` message; none for an unset one (an older peer) or a size below 2.

    Lenient, not an error: n-grams are guesses for drafters' pools (whoever drafts from them checks their ids),
    and a round must not fail over a hint. Tokens past the last whole n-gram are dropped.
    """
    size = message.size
    if size < 2:
        return ()
    flat = list(message.token_ids)
    return tuple(tuple(flat[i : i + size]) for i in range(0, len(flat) - size + 1, size))


def prefill_result_to_proto(result: PrefillResult) -> verifier_pb2.PrefillResponse:
    return verifier_pb2.PrefillResponse(
        prefill_ns=result.prefill_ns,
        features=features_to_proto(result.features),
        num_cached_tokens=result.cached_tokens,
    )


def prefill_result_from_proto(message: verifier_pb2.PrefillResponse) -> PrefillResult:
    """ValueError when the features are malformed."""
    return PrefillResult(int(message.prefill_ns), features_from_proto(message.features), message.num_cached_tokens)


def verify_result_to_proto(result: VerifyResult) -> verifier_pb2.VerifyResponse:
    return verifier_pb2.VerifyResponse(
        accepted_token_ids=result.accepted_tokens,
        accepted_node_indices=result.accepted_nodes,
        bonus_token_id=result.bonus_token,
        verify_ns=result.verify_ns,
        successor_token_ids=[token for row in result.successors for token in row],
        features=features_to_proto(result.features),
        draft_budget_nodes=result.draft_budget_nodes,
        batch_sessions=result.batch_sessions,
        queue_ns=result.queue_ns,
        lookahead_ngrams=ngrams_to_proto(result.lookahead_ngrams),
    )


def verify_result_from_proto(message: verifier_pb2.VerifyResponse, num_successors: int) -> VerifyResult:
    """The result of a Verify that asked for ``num_successors`` per position; ValueError for malformed features."""
    flat = list(message.successor_token_ids)
    k = num_successors
    rows = [flat[i : i + k] for i in range(0, len(flat), k)] if k > 0 else []
    return VerifyResult(
        list(message.accepted_token_ids),
        list(message.accepted_node_indices),
        message.bonus_token_id,
        message.verify_ns,
        rows,
        features_from_proto(message.features),
        draft_budget_nodes=message.draft_budget_nodes if message.HasField("draft_budget_nodes") else None,
        batch_sessions=message.batch_sessions,
        queue_ns=message.queue_ns,
        lookahead_ngrams=ngrams_from_proto(message.lookahead_ngrams),
    )


def feedback_to_proto(feedback: DraftFeedback, max_nodes: int, features: np.ndarray | None) -> drafter_pb2.ProposeTree:
    """A propose carrying ``features`` (the last slice of the feedback's: earlier ones travel as FeatureChunks)."""
    return drafter_pb2.ProposeTree(
        new_token_ids=feedback.new_tokens,
        max_nodes=max_nodes,
        successors=[
            drafter_pb2.TokenSuccessors(token_id=token, next_token_ids=following)
            for token, following in feedback.successors
        ],
        features=features_to_proto(features),
        accepted_node_indices=feedback.accepted_node_indices,
        forced_prefix=feedback.forced_prefix,
        lookahead_ngrams=ngrams_to_proto(feedback.lookahead_ngrams),
    )


def feedback_from_proto(message: drafter_pb2.ProposeTree, features: np.ndarray | None) -> DraftFeedback:
    """The feedback of a propose, with its features already read (and joined to any chunks sent ahead)."""
    return DraftFeedback(
        tuple(message.new_token_ids),
        tuple((s.token_id, tuple(s.next_token_ids)) for s in message.successors),
        features,
        tuple(message.accepted_node_indices),
        tuple(message.forced_prefix),
        lookahead_ngrams=ngrams_from_proto(message.lookahead_ngrams),
    )


def draft_reply_to_proto(reply: DraftReply) -> drafter_pb2.DraftResponse:
    return drafter_pb2.DraftResponse(
        tree=tree_to_proto(reply.tree),
        draft_ns=reply.draft_ns,
        predrafted=reply.predrafted,
        predraft_ns=reply.predraft_ns,
        probe_ns=reply.probe_ns,
        wants_features=reply.wants_features,
    )


def draft_reply_from_proto(message: drafter_pb2.DraftResponse) -> DraftReply:
    return DraftReply(
        tree_from_proto(message.tree),
        int(message.draft_ns),
        message.predrafted,
        int(message.predraft_ns),
        max(0, int(message.probe_ns)),
        message.wants_features,
    )


def verified_tree_to_proto(verified: VerifiedTree) -> drafter_pb2.VerifiedTree:
    """The verified tree's shape only: the drafter pre-drafts from it, it needs no draft distributions."""
    tree = common_pb2.TokenTree(token_ids=verified.tree.token_ids, parents=verified.tree.parents)
    allowed = [drafter_pb2.AllowedNext(node=node, token_ids=tokens) for node, tokens in verified.allowed_next.items()]
    return drafter_pb2.VerifiedTree(
        tree=tree, forced=verified.forced if any(verified.forced) else (), allowed_next=allowed
    )


def verified_tree_from_proto(message: drafter_pb2.VerifiedTree, vocab_size: int) -> VerifiedTree:
    """ValueError (InvalidTreeError included) naming the problem when the tree is malformed."""
    vocab_size = vocab_size or 2**31 - 1
    tree = TokenTree(tuple(message.tree.token_ids), tuple(message.tree.parents))
    tree.validate(vocab_size, max_nodes=len(tree))
    allowed = {a.node: tuple(a.token_ids) for a in message.allowed_next}
    if len(allowed) != len(message.allowed_next):
        raise ValueError("allowed_next lists a node twice")
    if any(not 0 <= t < vocab_size for tokens in allowed.values() for t in tokens):
        raise ValueError(f"allowed_next holds a token id outside the vocabulary [0, {vocab_size})")
    return VerifiedTree(tree, tuple(message.forced), allowed)
