"""Evicted verifier sessions, and the n-gram pool shared by two drafters through a real Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from tests.integration.conftest import FP32_VERIFIER, Target
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration


def generate(address: str, text: str, max_new_tokens: int) -> tuple[list[int], Stats]:
    tokens: list[int] = []
    with SpecserveClient(address) as client:
        for event in client.generate_chat([("user", text)], GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
            else:
                return tokens, event
    raise AssertionError("the stream ended without stats")


@pytest.fixture(scope="module")
def one_session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A verifier that holds a single session: any other prefill evicts the running one."""
    logs = tmp_path_factory.mktemp("one-session")
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs)
    cluster.extra_verifier_args = ["--max-sessions", "1", *FP32_VERIFIER]
    with cluster:
        yield cluster


def test_evicted_sessions_are_rebuilt_without_losing_or_repeating_tokens(
    one_session_cluster: LocalCluster, target: Target
) -> None:
    text = "Write a long story about a dragon who learns to read."
    stop = threading.Event()

    def evict_repeatedly() -> None:
        # A prefill evicts the generation's session unless that session is in the same engine step (then the
        # store holds one extra until the next put): so try often, and release each intruder at once, so that
        # the generation's session is the one left to evict next time.
        with grpc.insecure_channel(one_session_cluster.verifier_address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            while not stop.wait(0.3):
                session_id = uuid.uuid4().hex
                stub.Prefill(verifier_pb2.PrefillRequest(session_id=session_id, token_ids=[1, 2, 3]), timeout=30)
                stub.Release(verifier_pb2.ReleaseRequest(session_id=session_id), timeout=30)

    evictor = threading.Thread(target=evict_repeatedly)
    evictor.start()
    try:
        tokens, stats = generate(one_session_cluster.coordinator_address, text, 96)
    finally:
        stop.set()
        evictor.join()
    assert tokens == target.greedy(target.chat_ids(text), 96)
    print(f"reprefills: {stats.num_reprefills} in {stats.num_rounds} rounds")
    assert stats.num_reprefills >= 2


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def two_clusters(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """Two complete deployments (A and B) whose drafters share one private Redis."""
    logs = tmp_path_factory.mktemp("shared-pool")
    with (
        LocalCluster(
            free_port(),
            free_port(),
            free_port(),
            redis_url=redis_server.url,
            log_dir=logs / "a",
            extra_verifier_args=list(FP32_VERIFIER),
        ) as a,
        LocalCluster(
            free_port(),
            free_port(),
            free_port(),
            redis_url=redis_server.url,
            log_dir=logs / "b",
            extra_verifier_args=list(FP32_VERIFIER),
        ) as b,
    ):
        yield a, b


def restart_drafter(cluster: LocalCluster) -> None:
    """A fresh drafter process: nothing learnt locally survives."""
    cluster.kill("drafter")
    cluster.start_drafter()
    wait_serving(cluster.drafter_address, 60, cluster.processes["drafter"])


TEXT = "List the planets of the solar system in order, with one fact about each."


def test_traffic_through_one_drafter_teaches_the_other(
    two_clusters: tuple[LocalCluster, LocalCluster], redis_server: RedisServer, target: Target
) -> None:
    a, b = two_clusters
    expected = target.greedy(target.chat_ids(TEXT), 96)
    redis.Redis.from_url(redis_server.url).flushdb()
    cold_tokens, cold = generate(b.coordinator_address, TEXT, 96)
    restart_drafter(b)
    redis.Redis.from_url(redis_server.url).flushdb()
    taught_tokens, _ = generate(a.coordinator_address, TEXT, 96)
    warm_tokens, warm = generate(b.coordinator_address, TEXT, 96)
    assert cold_tokens == taught_tokens == warm_tokens == expected
    print(f"drafter B cold: {cold.summary()}\ndrafter B after A's traffic: {warm.summary()}")
    assert warm.tau > cold.tau + 0.3


def test_killing_redis_mid_generation_keeps_the_output_identical(
    two_clusters: tuple[LocalCluster, LocalCluster], redis_server: RedisServer, target: Target
) -> None:
    _, b = two_clusters
    text = "Write a long story about a dragon who learns to read."
    result: list[tuple[list[int], Stats]] = []

    def consume() -> None:
        result.append(generate(b.coordinator_address, text, 128))

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(2.0)  # a few rounds in
    redis_server.stop()
    consumer.join(timeout=300)
    assert not consumer.is_alive() and result
    tokens, stats = result[0]
    assert tokens == target.greedy(target.chat_ids(text), 128)
    assert stats.num_generated_tokens == 128
