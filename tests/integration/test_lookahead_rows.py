"""Lookahead rows through the three processes: the verifier's Jacobi n-grams reach the drafter's Redis pool, and
the output stays plain greedy decoding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from tests.integration.conftest import EVERY_ROUND_DRAFTS, Target
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

TEXT = "Count from one to twenty in words, separated by commas."
TOKENS = 48


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def lookahead_cluster(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Lookahead forced on (a CPU's curve would turn ``auto`` off), a drafter drafting from its n-grams alone."""
    logs = tmp_path_factory.mktemp("lookahead")
    cluster = LocalCluster(free_port(), free_port(), free_port(), redis_url=redis_server.url, log_dir=logs)
    cluster.extra_verifier_args = [*EVERY_ROUND_DRAFTS, "--lookahead", "on", "--lookahead-window", "6"]
    cluster.extra_drafter_args = ["--sources", "lookahead"]
    with cluster:
        wait_serving(cluster.drafter_address, 120, cluster.processes["drafter"])
        yield cluster


def generate(address: str, text: str, max_new_tokens: int) -> tuple[list[int], Stats]:
    tokens: list[int] = []
    with SpecserveClient(address) as client:
        for event in client.generate_chat([("user", text)], GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
            else:
                return tokens, event
    raise AssertionError("the stream ended without stats")


def test_lookahead_n_grams_reach_redis_and_the_output_is_plain_greedy(
    lookahead_cluster: LocalCluster, redis_server: RedisServer, target: Target
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    tokens, stats = generate(lookahead_cluster.coordinator_address, TEXT, TOKENS)
    assert tokens == target.greedy(target.chat_ids(TEXT), TOKENS)
    print(stats.summary())
    keys = [key.decode() for key in client.scan_iter(match="specserve:*:lookahead:ng:1:*")]
    assert keys, "no lookahead n-gram reached the shared pool"
