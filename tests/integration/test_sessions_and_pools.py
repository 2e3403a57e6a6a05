"""Evicted verifier sessions, and the n-gram pool drafters share through a real Redis."""

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
from tests.conftest import wait_until
from tests.integration.conftest import EVERY_ROUND_DRAFTS, EVERY_ROUND_DRAFTS_COORDINATOR, FP32_VERIFIER, Target
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
    """A verifier that holds a single session: any other prefill evicts the running one while it is idle. Its rounds
    take turns (no Verify sent ahead), so it is idle between them; a session with a call queued is never evicted."""
    logs = tmp_path_factory.mktemp("one-session")
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs)
    cluster.extra_verifier_args = ["--max-sessions", "1", *FP32_VERIFIER]
    cluster.extra_coordinator_args = ["--no-verify-ahead"]
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
            while not stop.wait(0.1):  # 96 tokens take about a second on a fast CPU
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
def pool_cluster(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A deployment whose drafter drafts from an n-gram pool in a private Redis (which a test here stops)."""
    logs = tmp_path_factory.mktemp("shared-pool")
    cluster = LocalCluster(free_port(), free_port(), free_port(), redis_url=redis_server.url, log_dir=logs)
    # No throughput guard: its timed A/B of drafting against none (8 s, then a 3 s probe) would decide whether a
    # 2-second request drafts at all, by when it starts; this measures what the pool teaches.
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    cluster.extra_coordinator_args = [
        *EVERY_ROUND_DRAFTS_COORDINATOR,
        "--drafter-backoff-ms",
        "200",
    ]  # a restarted drafter is used again soon
    # Drafts from the shared pool alone: what a request gains is what the pool holds, nothing else.
    cluster.extra_drafter_args = ["--sources", "ngram_pool"]
    with cluster:
        wait_serving(cluster.drafter_address, 120, cluster.processes["drafter"])
        yield cluster


def restart_drafter(cluster: LocalCluster) -> None:
    """A fresh drafter process: nothing learnt locally survives. Returns once requests draft through it again.

    Requests skip a drafter that failed (the kill) until the coordinator's probe finds it healthy again.
    """
    cluster.kill("drafter")
    cluster.start_drafter()
    wait_serving(cluster.drafter_address, 60, cluster.processes["drafter"])
    wait_until(
        lambda: not generate(cluster.coordinator_address, "Say hi.", 2)[1].drafter_error,
        60,
        "the coordinator takes the restarted drafter back",
    )


REDIS_DOWN = "redis n-gram pool unavailable"  # the drafter's warning (draft_service.redis_pool)
TEXT = "List the planets of the solar system in order, with one fact about each."
POOL_TOKENS = 64


def test_traffic_through_one_drafter_teaches_the_next(
    pool_cluster: LocalCluster, redis_server: RedisServer, target: Target
) -> None:
    """Drafter processes share what they learn only through Redis: a fresh one drafts from its predecessor's traffic.

    The first request meets an empty pool and a drafter that has seen nothing. Its drafter is then replaced by a
    new process (its in-memory pools, successor tables and acceptance statistics are gone), so what the second
    request gains, it gains from the n-grams the first drafter wrote to Redis.
    """
    expected = target.greedy(target.chat_ids(TEXT), POOL_TOKENS)
    redis.Redis.from_url(redis_server.url).flushdb()
    cold_tokens, cold = generate(pool_cluster.coordinator_address, TEXT, POOL_TOKENS)
    restart_drafter(pool_cluster)
    warm_tokens, warm = generate(pool_cluster.coordinator_address, TEXT, POOL_TOKENS)
    assert cold_tokens == warm_tokens == expected
    print(f"fresh drafter, empty pool: {cold.summary()}\nfresh drafter, taught pool: {warm.summary()}")
    # The pool is the only source: the first request found it empty, the second finds the first one's text. (A
    # fresh drafter trusts a source little until it has seen it accepted, so the gain grows with the length.)
    assert warm.num_accepted_tokens >= cold.num_accepted_tokens + 8


def test_killing_redis_mid_generation_keeps_the_output_identical(
    pool_cluster: LocalCluster, redis_server: RedisServer, target: Target
) -> None:
    text = "Write a long story about a dragon who learns to read."
    first_chunk = threading.Event()
    result: list[tuple[list[int], Stats]] = []

    def consume() -> None:
        tokens: list[int] = []
        with SpecserveClient(pool_cluster.coordinator_address) as client:
            for event in client.generate_chat([("user", text)], GenerationParams(max_new_tokens=POOL_TOKENS)):
                if isinstance(event, TextChunk):
                    tokens += event.token_ids
                    first_chunk.set()
                else:
                    result.append((tokens, event))

    drafter_log = pool_cluster.log_dir / "drafter.log" if pool_cluster.log_dir else None
    assert drafter_log is not None
    warnings_before = drafter_log.read_text().count(REDIS_DOWN)
    consumer = threading.Thread(target=consume)
    sent = time.monotonic()
    consumer.start()
    assert first_chunk.wait(300), "no token arrived"  # the first round is done: it drafted from a live Redis
    redis_server.stop()  # SIGKILL, and waits until the process is gone
    killed_after_s = time.monotonic() - sent
    consumer.join(timeout=300)
    assert not consumer.is_alive() and result
    tokens, stats = result[0]
    assert tokens == target.greedy(target.chat_ids(text), POOL_TOKENS)
    assert stats.num_generated_tokens == POOL_TOKENS
    print(f"Redis killed {killed_after_s:.2f} s after the request was sent; the generation took {stats.total_s:.2f} s")
    # The kill landed mid-stream: the coordinator began the generation no earlier than the request was sent, and
    # ended it total_s later, after Redis was gone (a kill after the end would leave this test proving nothing).
    assert killed_after_s < stats.total_s, (
        f"Redis died {killed_after_s:.2f} s after the request was sent, but the generation took only "
        f"{stats.total_s:.2f} s: it had ended before the kill"
    )
    # And the drafter met the dead Redis (and drafted on without it).
    assert drafter_log.read_text().count(REDIS_DOWN) > warnings_before
