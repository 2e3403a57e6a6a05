"""The coordinator under load and failure: admission limits, client deadlines, a verifier replica killed.

One cluster for the file: two fp32 verifier replicas (no drafter: it plays no part here) behind a coordinator
that runs at most 2 streams with 1 waiting. Outputs are compared token for token with plain greedy decoding.
The replica-killing test runs next to last (it leaves one replica), the drain test last (it stops the
coordinator).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from tests.conftest import wait_until
from tests.integration.conftest import FP32_VERIFIER, Target

pytestmark = pytest.mark.integration

PROMPT = "Explain in a few sentences why the sky is blue."
LONG_PROMPT = "Count from 1 to 1000, one number per line."
MAX_RUNNING, MAX_QUEUED = 2, 1
FAILOVER_TOKENS = 48


@pytest.fixture(scope="module")
def reference(target: Target) -> list[int]:
    """Plain greedy decoding of PROMPT; a shorter request's output is a prefix of it."""
    return target.greedy(target.chat_ids(PROMPT), FAILOVER_TOKENS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        free_port(),
        free_port(),
        free_port(),
        with_drafter=False,
        num_verifiers=2,
        log_dir=tmp_path_factory.mktemp("admission-logs"),
        # Two replicas share the test machine's cores: one thread each, no start-up profiling (no drafts here).
        extra_verifier_args=[*FP32_VERIFIER, "--no-profile-cost", "--torch-threads", "1"],
        extra_coordinator_args=[
            "--max-concurrent-streams",
            str(MAX_RUNNING),
            "--max-queued-streams",
            str(MAX_QUEUED),
        ],
    )
    with cluster as c:
        yield c


@dataclass
class Outcome:
    tokens: list[int]
    stats: Stats | None = None
    error: grpc.RpcError | None = None


def generate(address: str, max_new_tokens: int, timeout_s: float = 120.0, prompt: str = PROMPT) -> Outcome:
    outcome = Outcome([])
    try:
        with SpecserveClient(address, timeout_s=timeout_s) as client:
            for event in client.generate_chat([("user", prompt)], GenerationParams(max_new_tokens=max_new_tokens)):
                if isinstance(event, TextChunk):
                    outcome.tokens += event.token_ids
                else:
                    outcome.stats = event
    except grpc.RpcError as exc:
        outcome.error = exc
    return outcome


def active_sessions(cluster: LocalCluster) -> dict[str, int]:
    """Each live verifier replica's session count, by process name."""
    counts = {}
    for name, address in cluster.verifier_addresses.items():
        if name in cluster.processes:
            with grpc.insecure_channel(address) as channel:
                info = verifier_pb2_grpc.VerifierServiceStub(channel).VerifierInfo(
                    verifier_pb2.VerifierInfoRequest(), timeout=10
                )
                counts[name] = info.num_active_sessions
    return counts


def wait_for_no_sessions(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    wait_until(
        lambda: not any(active_sessions(cluster).values()), timeout_s, "every verifier replica frees its sessions"
    )


def test_streams_over_the_limits_are_refused_with_retry_after(cluster: LocalCluster, reference: list[int]) -> None:
    max_new = 12
    outcomes: list[Outcome] = [Outcome([]) for _ in range(6)]
    start = threading.Barrier(len(outcomes))

    def client(i: int) -> None:
        start.wait()
        outcomes[i] = generate(cluster.coordinator_address, max_new)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(outcomes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [o.error for o in outcomes if o.error is not None]
    served = [o for o in outcomes if o.error is None]
    expected = reference[:max_new]
    queued = sorted(o.stats.queue_s for o in served if o.stats is not None)
    print(f"\n{len(served)} served (queue {', '.join(f'{q:.2f}' for q in queued)} s), {len(refused)} refused")
    assert len(served) >= MAX_RUNNING and refused  # six at once: at most 2 running + 1 waiting at a time
    for outcome in served:
        assert outcome.tokens == expected
    assert queued[-1] > 0  # one waited for a slot
    for error in refused:
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry_ms = dict(error.trailing_metadata() or ())["retry-after-ms"]
        assert int(retry_ms) > 0 and f"retry after {retry_ms} ms" in (error.details() or "")
    wait_for_no_sessions(cluster)


def test_a_passed_deadline_ends_the_stream_and_frees_its_session(cluster: LocalCluster) -> None:
    # A long answer: the sky's a few sentences end well within a second on a fast CPU step.
    outcome = generate(cluster.coordinator_address, max_new_tokens=2000, timeout_s=1.0, prompt=LONG_PROMPT)
    assert isinstance(outcome.error, grpc.Call)
    assert outcome.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert outcome.stats is None
    wait_for_no_sessions(cluster, timeout_s=5.0)


def test_a_killed_verifier_replica_costs_no_token(cluster: LocalCluster, reference: list[int]) -> None:
    tokens: list[int] = []
    stats: Stats | None = None
    killed = ""
    with SpecserveClient(cluster.coordinator_address, timeout_s=120) as client:
        for event in client.generate_chat([("user", PROMPT)], GenerationParams(max_new_tokens=FAILOVER_TOKENS)):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
                if not killed:
                    counts = active_sessions(cluster)
                    killed = next(name for name, count in counts.items() if count)
                    cluster.kill(killed)  # SIGKILL, mid-stream: its session and KV cache are gone
                    print(f"\nkilled {killed} after {len(tokens)} tokens")
            else:
                stats = event
    assert stats is not None
    print(stats.summary(), f"| {stats.num_reprefills} re-prefills")
    assert tokens == reference
    assert stats.num_reprefills >= 1
    assert "127.0.0.1" not in stats.drafter_error and "verifier at" not in stats.drafter_error  # none reach clients


# The coordinator's SIGTERM drain (running streams finish, new ones are refused) is tests/integration/test_drain.py.
