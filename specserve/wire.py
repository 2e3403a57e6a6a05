"""Protobuf <-> domain conversions shared by the services' gRPC edges."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from specserve.sampling import SamplingParams
from specserve.token_masks import TokenMasks
from specserve.token_tree import DraftDistribution, TokenTree
from specserve.v1 import common_pb2, verifier_pb2


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
