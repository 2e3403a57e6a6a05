"""Target features travel to the drafter in bounded chunks and arrive whole, in order."""

import asyncio

import numpy as np
import pytest

from coordinator.grpc_clients import FEATURE_CHUNK_BYTES, GrpcDraftStream
from draft_service.server import FeaturesAhead
from specserve import errors
from specserve.results import DraftFeedback
from specserve.v1 import common_pb2, drafter_pb2
from specserve.wire import features_from_proto, features_to_proto, split_features

GRPC_DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # what the drafter's server accepts


def features(rows: int, hidden: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float16)


@pytest.mark.parametrize(
    ("rows", "hidden", "max_bytes"),
    [(0, 8, 64), (1, 8, 64), (4, 8, 64), (5, 8, 64), (17, 8, 64), (3, 100, 64), (6000, 576, FEATURE_CHUNK_BYTES)],
)
def test_split_then_concatenate_is_the_identity_and_every_slice_is_bounded(
    rows: int, hidden: int, max_bytes: int
) -> None:
    whole = features(rows, hidden)
    slices = split_features(whole, max_bytes)
    assert sum(s.shape[0] for s in slices) == rows
    assert all(s.shape[0] > 0 and s.shape[1] == hidden for s in slices)
    # A slice is bounded, or a single row wider than the bound.
    assert all(s.nbytes <= max_bytes or s.shape[0] == 1 for s in slices)
    # Only the last slice may be short: as few messages as the bound allows.
    assert all(s.shape[0] == slices[0].shape[0] for s in slices[:-1])
    rejoined = np.concatenate(slices) if slices else np.zeros((0, hidden), np.float16)
    assert np.array_equal(rejoined, whole)


class RecordingCall:
    """A Draft stream's client end that records what is written and answers each propose with an empty tree."""

    def __init__(self) -> None:
        self.written: list[drafter_pb2.DraftRequest] = []

    async def write(self, request: drafter_pb2.DraftRequest) -> None:
        self.written.append(request)

    async def read(self) -> drafter_pb2.DraftResponse:
        return drafter_pb2.DraftResponse(tree=common_pb2.TokenTree(), draft_ns=1)


def drafter_side(written: list[drafter_pb2.DraftRequest]) -> np.ndarray | None:
    """What the drafter's server hands the session for the propose that ends ``written``."""
    ahead = FeaturesAhead()
    for request in written[:-1]:
        assert request.WhichOneof("action") == "features"
        ahead.add(request.features)
    assert written[-1].WhichOneof("action") == "propose"
    return ahead.take(features_from_proto(written[-1].propose.features))


@pytest.mark.parametrize("rows", [0, 1, 100, 910, 911, 6000])
def test_a_long_prompts_features_go_ahead_in_chunks_and_the_drafter_gets_them_all(rows: int) -> None:
    whole = features(rows, 576, seed=rows)  # SmolLM2's hidden size: 910 rows fit in 1 MiB
    call = RecordingCall()
    stream = GrpcDraftStream(call, "test", wants_features=True)
    new_tokens = tuple(range(8192))  # a whole context's worth of committed tokens in one report
    asyncio.run(stream.propose(DraftFeedback(new_tokens, (), whole), max_nodes=8))

    assert len(call.written) == max(1, -(-rows // 910))
    for request in call.written:
        assert request.ByteSize() < GRPC_DEFAULT_MAX_MESSAGE_BYTES
        assert len(request.features.features.float16_data) <= FEATURE_CHUNK_BYTES
    propose = call.written[-1].propose
    assert list(propose.new_token_ids) == list(new_tokens) and propose.max_nodes == 8
    rebuilt = drafter_side(call.written)
    assert rebuilt is not None and np.array_equal(rebuilt, whole)


def test_no_features_send_no_chunks() -> None:
    call = RecordingCall()
    stream = GrpcDraftStream(call, "test", wants_features=False)
    asyncio.run(stream.propose(DraftFeedback((1, 2)), max_nodes=4))
    assert [r.WhichOneof("action") for r in call.written] == ["propose"]
    assert drafter_side(call.written) is None


def chunk(rows: np.ndarray) -> drafter_pb2.FeatureChunk:
    return drafter_pb2.FeatureChunk(features=features_to_proto(rows))


def test_chunks_of_another_width_or_malformed_are_invalid_arguments() -> None:
    ahead = FeaturesAhead()
    ahead.add(chunk(features(3, 8)))
    with pytest.raises(errors.InvalidArgument, match="hidden size 4, but the chunks before it have 8"):
        ahead.add(chunk(features(2, 4)))
    with pytest.raises(errors.InvalidArgument, match=r"propose\.features: hidden size 4"):
        ahead.take(features(2, 4))
    short = common_pb2.HiddenFeatures(num_positions=2, hidden_size=8, float16_data=b"\0" * 30)
    with pytest.raises(errors.InvalidArgument, match="carry 30 bytes"):
        ahead.add(drafter_pb2.FeatureChunk(features=short))
    with pytest.raises(errors.InvalidArgument, match="must carry features"):
        ahead.add(drafter_pb2.FeatureChunk())


def test_buffering_past_the_bound_is_resource_exhausted_and_a_propose_empties_the_buffer() -> None:
    ahead = FeaturesAhead(max_bytes=2 * 4 * 8 * 2)  # two chunks of 4 rows x 8 float16
    first, second = features(4, 8, 1), features(4, 8, 2)
    ahead.add(chunk(first))
    ahead.add(chunk(second))
    rebuilt = ahead.take(None)
    assert rebuilt is not None and np.array_equal(rebuilt, np.concatenate([first, second]))
    assert ahead.take(None) is None
    for _ in range(2):
        ahead.add(chunk(first))
    with pytest.raises(errors.ResourceExhausted, match="sent ahead of a propose"):
        ahead.add(chunk(first))
