"""The in-memory and the Redis pool pass the same tests (real redis-server on a free port)."""

from collections.abc import Iterator

import pytest
import redis

from draft_service.ngram_pool import InMemoryNgramPool, NgramPool, PoolShape
from draft_service.redis_pool import RedisNgramPool
from tests.redis_server import RedisServer

SHAPE = PoolShape(key_len=2, continuation_len=2, max_continuations=2)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
def pool(request: pytest.FixtureRequest) -> Iterator[NgramPool]:
    if request.param == "memory":
        yield InMemoryNgramPool(SHAPE)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    yield RedisNgramPool(client, "fp", SHAPE)
    client.close()


def test_records_windows_and_ranks_by_count(pool: NgramPool) -> None:
    pool.record([1, 2, 3, 4])  # (1,2)->(3,4)
    pool.record([1, 2, 5, 6, 1, 2, 5, 6])  # (1,2)->(5,6) twice
    assert pool.lookup([1, 2]) == [(5, 6), (3, 4)]
    assert pool.lookup([2, 5]) == [(6, 1)]
    assert pool.lookup([9, 9]) == []


def test_keeps_only_the_most_frequent_continuations(pool: NgramPool) -> None:
    for continuation, times in (((3, 3), 3), ((4, 4), 2), ((5, 5), 1)):
        for _ in range(times):
            pool.record([1, 2, *continuation])
    assert pool.lookup([1, 2]) == [(3, 3), (4, 4)]


def test_equal_counts_rank_the_same_in_both_pools(pool: NgramPool) -> None:
    pool.record([1, 2, 10, 3])
    pool.record([1, 2, 9, 3])
    assert pool.lookup([1, 2]) == [(9, 3), (10, 3)]  # by storage string, descending: "9,3" > "10,3"


def test_start_records_each_window_once(pool: NgramPool) -> None:
    tokens = [1, 2, 3, 4, 5]
    pool.record(tokens[:4])
    pool.record(tokens, start=4)
    pool.record(tokens, start=5)  # nothing new
    assert pool.lookup([1, 2]) == [(3, 4)]
    assert pool.lookup([2, 3]) == [(4, 5)]


def test_redis_pool_ignores_foreign_and_corrupt_members(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    pool = RedisNgramPool(client, "fp", SHAPE)
    pool.record([1, 2, 3, 4])
    pool.flush()
    key = "specserve:fp:ng:2:1,2"
    client.zadd(key, {b"\xff\xfe": 50, "not,numbers": 40, "1,2,3": 30})
    assert pool.lookup([1, 2]) == [(3, 4)]
    other = RedisNgramPool(client, "other-model", SHAPE)
    assert other.lookup([1, 2]) == []


def test_redis_pool_degrades_when_redis_is_down() -> None:
    from tests.redis_server import free_port

    client = redis.Redis(port=free_port(), socket_timeout=0.05, socket_connect_timeout=0.05)
    pool = RedisNgramPool(client, "fp", SHAPE, retry_after_s=60)
    pool.record([1, 2, 3, 4])  # no exception
    assert pool.lookup([1, 2]) == []
    assert not pool.available
