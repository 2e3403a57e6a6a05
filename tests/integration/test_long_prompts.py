"""A prompt whose target features pass gRPC's 4 MiB message limit still drafts, and stays lossless."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.conftest import wait_until
from tests.integration.conftest import EVERY_ROUND_DRAFTS, EVERY_ROUND_DRAFTS_COORDINATOR, Target, spec_bench_prompts
from tests.integration.test_end_to_end import generate

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_TOKENS = 4000  # 4.6 MB of float16 features: more than one gRPC message may carry
HIDDEN_SIZE = 576  # SmolLM2-135M's: 1,152 float16 bytes of features per prompt token
GRPC_DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def head_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A drafter that drafts from the draft head alone, so every draft token proves the features arrived.

    The coordinator keeps its default draft timeout: feeding the head 4,000 prompt positions takes over a
    second of CPU on 2 cores, which the drafter does between rounds (``HeadProposer.digest``), never while a
    proposal waits. Only the verifier timeout is raised, so that a busy machine's slow 4,000-token prefill is
    not an error.

    Draft budgets follow the tree limits (``--no-profile-cost``, as in conftest's cluster): with the measured
    cost curve of a 2-core CPU and a 4,000-token context, the budget fell to 0 nodes after the head's first
    tree (seen in CI), and the 24 rounds asked the head for nothing.

    Without the throughput guard too: its probes are timed (3 s without drafts every 8 s), and the 24 rounds
    after a 4,000-token prefill take about 2.5 s, so a probe could cover all of them (seen in CI: no draft
    token, no drafter error).
    """
    logs = tmp_path_factory.mktemp("head-cluster-logs")
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs)
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    cluster.extra_drafter_args = ["--sources", "draft_model"]
    cluster.extra_coordinator_args = [*EVERY_ROUND_DRAFTS_COORDINATOR, "--verifier-timeout-s", "600"]
    with cluster as c:
        # The coordinator serves before the drafter has loaded: wait until requests draft.
        wait_serving(c.drafter_address, 600)
        wait_until(lambda: not generate(c.coordinator_address, "Say hi.", 2)[2].drafter_error, 60, "requests draft")
        yield c


def long_chat(target: Target, min_tokens: int) -> str:
    """Spec-Bench requests, one after another, until the chat has ``min_tokens`` tokens, then one question."""
    texts: list[str] = []
    for record in spec_bench_prompts(per_category=20):
        texts.append(record["turns"][0])
        if len(target.chat_ids("\n\n".join(texts))) >= min_tokens:
            return "\n\n".join(texts) + "\n\nIn one sentence: what do the requests above have in common?"
    raise AssertionError(f"Spec-Bench has fewer than {min_tokens} tokens of prompts")


def test_a_4000_token_prompt_drafts_from_the_head_and_is_token_identical_to_plain_greedy(
    head_cluster: LocalCluster, target: Target
) -> None:
    text = long_chat(target, PROMPT_TOKENS)
    prompt_ids = target.chat_ids(text)
    assert (len(prompt_ids) - 1) * HIDDEN_SIZE * 2 > GRPC_DEFAULT_MAX_MESSAGE_BYTES  # one message could not carry it
    # The head digests the prompt in steps between the first rounds, then drafts.
    tokens, streamed, stats = generate(head_cluster.coordinator_address, text, 24)
    print(
        f"{len(prompt_ids)} prompt tokens: {stats.summary()}; {stats.num_draft_tokens} draft tokens, "
        f"{stats.num_accepted_tokens} accepted"
    )
    assert stats.drafter_error == ""
    assert stats.num_draft_tokens > 0 and stats.num_rounds_without_drafter == 0
    assert stats.num_prompt_tokens == len(prompt_ids)
    assert tokens == target.greedy(prompt_ids, 24)
    assert streamed == target.tokenizer.decode(tokens, skip_special_tokens=True)


def test_malformed_feature_chunks_are_invalid_arguments(head_cluster: LocalCluster) -> None:
    bad = {
        "carry 3 bytes": common_pb2.HiddenFeatures(num_positions=1, hidden_size=HIDDEN_SIZE, float16_data=b"abc"),
        "must carry features": common_pb2.HiddenFeatures(),
    }
    with grpc.insecure_channel(head_cluster.drafter_address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        fingerprint = stub.DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=30).vocab_fingerprint
        session = drafter_pb2.StartSession(
            session_id="chunks", prompt_token_ids=[1, 2, 3], vocab_fingerprint=fingerprint
        )
        start = drafter_pb2.DraftRequest(start=session)
        for message, features in bad.items():
            chunk = drafter_pb2.DraftRequest(features=drafter_pb2.FeatureChunk(features=features))
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Draft(iter([start, chunk]), timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()
