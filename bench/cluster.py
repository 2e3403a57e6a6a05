"""The distributed mode's processes and its Redis n-gram pool.

The benchmark uses a Redis database of its own (``/15`` by default) and empties
its n-gram keys before measuring: the pool keeps what it learned for days, so
a second run over the same prompts would otherwise draft from the first run's
outputs and report an acceptance no cold deployment would see.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis

from specserve.local_cluster import LocalCluster, free_port, wait_serving

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"


@dataclass(frozen=True)
class PoolBackend:
    redis_url: str | None  # None: the drafter's embedded in-memory pool
    description: str


def choose_pool(redis_url: str) -> PoolBackend:
    """Redis at ``redis_url`` when it answers a PING, else the in-memory pool (and why)."""
    if not redis_url:
        return PoolBackend(None, "in-memory (no Redis URL given)")
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError) as exc:
        return PoolBackend(None, f"in-memory (Redis at {redis_url} unreachable: {exc})")
    return PoolBackend(redis_url, f"redis {redis_url}")


# Redis databases of the distributed modes after the first (the benchmark's own is 15, the smoke tests' 14).
OTHER_DATABASES = {
    "distributed-no-predraft": 13,
    "distributed-predraft": 12,
    "distributed-unary": 11,
    "distributed-off-in-turn": 10,
}


def other_database(pool: PoolBackend, mode: str) -> PoolBackend:
    """The same Redis server, a database of ``mode``'s own (``OTHER_DATABASES``), for a second distributed mode."""
    if pool.redis_url is None:
        return pool
    url = urlsplit(pool.redis_url)._replace(path=f"/{OTHER_DATABASES[mode]}").geturl()
    return PoolBackend(url, f"redis {url} (`{mode}`'s own)")


def clear_pool(redis_url: str, fingerprint: str) -> int:
    """Delete the n-gram keys of one vocabulary, in every tenant's pool (``specserve:{namespace}:{fingerprint}:ng:*``,
    see draft_service.pools); returns how many."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        deleted = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"specserve:*:{fingerprint}:ng:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.delete(*batch))
                batch = []
        if batch:
            deleted += int(client.delete(*batch))
        return deleted
    finally:
        client.close()


def pool_reset(pool: PoolBackend, fingerprint: str, keep: bool = False) -> Callable[[], None] | None:
    """What empties ``pool``'s n-gram keys of one vocabulary (``clear_pool``) before measuring; None where there is
    nothing to empty (the drafter's in-memory pool) or the caller keeps what the pool learned."""
    redis_url = pool.redis_url
    if redis_url is None or keep:
        return None

    def reset() -> None:
        clear_pool(redis_url, fingerprint)

    return reset


class ClusterStartError(RuntimeError):
    """A service of the distributed mode exited while the cluster was starting."""


def start_cluster(
    model: str,
    pool: PoolBackend,
    torch_threads: int,
    log_dir: Path,
    timeout_s: float = 600.0,
    verifier_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
    drafter_args: Sequence[str] = (),
    cpus: dict[str, frozenset[int]] | None = None,
) -> LocalCluster:
    """Verifier, drafter and coordinator on free loopback ports; the verifier uses the harness's thread count.

    ``verifier_args`` go at the end of the verifier's command line (after ``--torch-threads`` and
    ``--kept-prefixes 0``, so they win: the benchmarks run one prompt in several modes on one cluster, and a
    released session's cache would hand the modes after the first a prompt already prefilled);
    ``coordinator_args`` at the end of the coordinator's (``--drafter ''`` runs without drafting), and
    ``drafter_args`` at the end of the drafter's. ``cpus`` pins services to CPUs (``bench.pinning``).

    LocalCluster.start() waits for the coordinator only, and the coordinator
    waits (for many minutes) for a verifier that may have died at start-up;
    here any child that exits stops the start at once, naming its log.
    """
    cluster = LocalCluster(
        coordinator_port=free_port(),
        drafter_port=free_port(),
        verifier_port=free_port(),
        model=model,
        redis_url=pool.redis_url,
        extra_verifier_args=["--torch-threads", str(torch_threads), "--kept-prefixes", "0", *verifier_args],
        extra_coordinator_args=list(coordinator_args),
        extra_drafter_args=list(drafter_args),
        log_dir=log_dir,
        cpus=dict(cpus or {}),
    )
    failure: list[BaseException] = []

    def start() -> None:
        try:
            cluster.start(timeout_s)
        except BaseException as exc:
            failure.append(exc)

    starter = threading.Thread(target=start, name="cluster-start", daemon=True)
    starter.start()
    while starter.is_alive():
        exited = [name for name, process in list(cluster.processes.items()) if process.poll() is not None]
        if exited:
            # The starter notices the exit too and stops the cluster itself: wait for it rather than
            # stopping concurrently (two stop() calls would race on the process table).
            starter.join(timeout=30)
            cluster.stop()
            logs = ", ".join(str(log_dir / f"{name}.log") for name in exited)
            raise ClusterStartError(f"{', '.join(exited)} exited while starting; see {logs}")
        time.sleep(0.5)
    if failure:
        raise ClusterStartError(f"the cluster did not start: {failure[0]} (logs in {log_dir})") from failure[0]
    # The coordinator serves before the drafter has loaded its draft head (many seconds of CPU): measuring
    # must not start while that load competes with the verifier, nor with requests that decode without drafts.
    try:
        wait_serving(cluster.drafter_address, timeout_s, *cluster.processes.values())
    except (RuntimeError, TimeoutError) as exc:
        cluster.stop()
        raise ClusterStartError(f"the drafter did not start: {exc} (logs in {log_dir})") from exc
    return cluster
