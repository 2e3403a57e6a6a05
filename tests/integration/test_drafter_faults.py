"""A drafter (or its Redis) can slow a request, never fail or change it, and a failing one is skipped.

Real processes: verifier (fp32), drafter and coordinator from LocalCluster,
with a private redis-server for the shared n-gram pool; a misbehaving drafter
is faked by a gRPC server in this process. Every output is compared token for
token with plain greedy decoding. Latency is compared side by side (per-request
drafting time and who paid a timeout), never against absolute thresholds.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
import redis

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from draft_service.pools import redis_namespace
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.model_loading import vocab_fingerprint
from specserve.tenancy import ANONYMOUS
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.conftest import wait_until
from tests.integration.conftest import FP32_VERIFIER, Target
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

MAX_NEW = 16
PROMPT = "List the planets of the solar system in order, one per line."
TIMEOUT_MS = 1000
BACKOFF_MS = 3000
# Short backoffs so a recovered drafter is back within seconds; the ceiling is the default --draft-timeout-ms.
HEALTH_ARGS = [
    "--draft-timeout-ms",
    str(TIMEOUT_MS),
    "--drafter-backoff-ms",
    str(BACKOFF_MS),
    "--drafter-max-backoff-ms",
    str(2 * BACKOFF_MS),
]


@dataclass
class Run:
    tokens: list[int]
    stats: Stats
    elapsed_s: float


def generate(address: str, text: str = PROMPT, max_new_tokens: int = MAX_NEW) -> Run:
    tokens: list[int] = []
    started = time.perf_counter()
    with SpecserveClient(address) as client:
        for event in client.generate_chat([("user", text)], GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
            else:
                return Run(tokens, event, time.perf_counter() - started)
    raise AssertionError("the stream ended without stats")


def report(case: str, runs: list[Run], baseline: Run | None) -> None:
    cells = ", ".join(
        f"{r.elapsed_s * 1000:.0f} ms (draft {r.stats.draft_s * 1000:.0f} ms, {r.stats.drafter_error[:16] or 'ok'})"
        for r in runs
    )
    healthy = f"healthy {baseline.elapsed_s * 1000:.0f} ms; " if baseline is not None else ""
    print(f"\n[{case}] {healthy}with the fault: {cells}")


def wait_until_drafting(address: str, timeout_s: float = 40.0) -> Run:
    """Requests until one uses the drafter again (the circuit closed after a probe)."""

    def drafting() -> Run | None:
        run = generate(address, max_new_tokens=4)
        return None if run.stats.drafter_error else run

    return wait_until(drafting, timeout_s, "the drafter comes back")


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, private_redis: RedisServer) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("fault-cluster-logs")
    cluster = LocalCluster(free_port(), free_port(), free_port(), redis_url=private_redis.url, log_dir=logs)
    cluster.extra_verifier_args = list(FP32_VERIFIER)
    cluster.extra_coordinator_args = list(HEALTH_ARGS)
    with cluster as c:
        # The coordinator serves before the drafter may (it decodes without one until it answers): under load a
        # first request could find the drafter not yet up and skip it for a backoff, which the tests here would
        # read as their fault's doing.
        wait_until_drafting(c.coordinator_address)
        yield c


@pytest.fixture(scope="module")
def reference(target: Target) -> list[int]:
    return target.greedy(target.chat_ids(PROMPT), MAX_NEW)


def test_poisoned_redis_entries_never_reach_the_verifier(
    cluster: LocalCluster, private_redis: RedisServer, target: Target, reference: list[int]
) -> None:
    """Out-of-vocabulary ids and garbage under every key the drafter reads: identical output, drafter kept."""
    baseline = generate(cluster.coordinator_address)
    assert baseline.tokens == reference
    context = target.chat_ids(PROMPT) + reference
    # The anonymous tenant's pool: this cluster runs without authentication.
    prefix = f"specserve:{redis_namespace(vocab_fingerprint(target.tokenizer), ANONYMOUS.pool_namespace)}:ng:3:"
    client = redis.Redis(port=private_redis.port)
    for i in range(3, len(context)):
        truth = context[i : i + 7]
        poison: dict[bytes | str, float] = {
            ",".join(map(str, [*truth, 10**6][:8])): 1e9,  # the right tokens, then an id past the vocabulary
            ",".join(["49152"] * 8): 1e9,  # exactly the vocabulary size
            ",".join(["-7"] * 8): 1e9,
            ",".join(["99999999999"] * 8): 1e9,  # not even an int32
            b"\xff\xfe\x00garbage": 1e9,
            "1,2": 1e9,  # the wrong length
            "a,b,c,d,e,f,g,h": 1e9,
        }
        client.zadd(prefix + ",".join(map(str, context[i - 3 : i])), poison)  # type: ignore[arg-type]
    runs = [generate(cluster.coordinator_address) for _ in range(3)]
    report("poisoned redis", runs, baseline)
    for run in runs:
        assert run.tokens == reference
        # A bad tree would have been caught by the coordinator and reported here: the drafter filtered them.
        assert run.stats.drafter_error == ""
        assert run.stats.num_rounds_without_drafter == 0


def assert_no_internals(client_text: str, address: str) -> None:
    """What a client sees of a worker's failure names no address and holds none of grpc's own text."""
    host, port = address.rsplit(":", 1)
    for internal in (host, f":{port}", "RPC", "debug_error_string", "StatusCode", "ipv4:"):
        assert internal not in client_text, (internal, client_text)


def test_a_stalled_drafter_costs_one_timeout_not_one_per_request(cluster: LocalCluster, reference: list[int]) -> None:
    baseline = wait_until_drafting(cluster.coordinator_address)
    baseline = generate(cluster.coordinator_address)
    drafter = cluster.processes["drafter"]
    drafter.send_signal(signal.SIGSTOP)
    try:
        runs = [generate(cluster.coordinator_address) for _ in range(3)]
    finally:
        drafter.send_signal(signal.SIGCONT)
    report("stalled drafter (SIGSTOP)", runs, baseline)
    first, *later = runs
    assert all(run.tokens == reference for run in runs)
    assert first.stats.drafter_error.startswith("drafter dropped: no answer within")
    for run in runs:
        assert_no_internals(run.stats.drafter_error, cluster.drafter_address)
    for run in later:
        # The first request paid the timeout; the next ones did not call the drafter at all (an open circuit skips
        # it before any call: tests/unit/test_drafter_health.py times that on a virtual clock).
        assert run.stats.drafter_error.startswith("drafter skipped: circuit open until"), run.stats.drafter_error
        assert run.stats.num_draft_tokens == 0
    wait_until_drafting(cluster.coordinator_address)


def test_a_killed_drafter_is_skipped_then_used_again_once_restarted(cluster: LocalCluster, target: Target) -> None:
    text = "Write a long story about a dragon who learns to read."
    long_reference = target.greedy(target.chat_ids(text), 32)
    baseline = wait_until_drafting(cluster.coordinator_address)
    baseline = generate(cluster.coordinator_address)
    with SpecserveClient(cluster.coordinator_address) as client:
        events = client.generate_chat([("user", text)], GenerationParams(max_new_tokens=32))
        tokens: list[int] = []
        killed = False
        for event in events:
            if isinstance(event, TextChunk):
                tokens += event.token_ids
                if not killed and len(tokens) >= 4:
                    cluster.kill("drafter")  # mid-run
                    killed = True
            else:
                stats = event
    assert killed and tokens == long_reference
    assert stats.drafter_error.startswith("drafter dropped")
    assert_no_internals(stats.drafter_error, cluster.drafter_address)
    try:
        runs = [generate(cluster.coordinator_address) for _ in range(3)]
        report("killed drafter", runs, baseline)
        for run in runs:
            assert run.tokens == baseline.tokens
            assert run.stats.drafter_error.startswith("drafter skipped"), run.stats.drafter_error
            assert_no_internals(run.stats.drafter_error, cluster.drafter_address)
    finally:
        cluster.start_drafter()
    wait_serving(cluster.drafter_address, 120)
    back = wait_until_drafting(cluster.coordinator_address)
    assert back.stats.num_rounds_without_drafter == 0


class BadDrafter(drafter_pb2_grpc.DrafterServiceServicer):
    """A misbehaving peer: answers every proposal at once, with the tree of ``mode``."""

    def __init__(self) -> None:
        self.mode = "out_of_vocabulary"
        self.trees_sent = 0

    def DrafterInfo(self, request: object, context: object) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(sources=["bad"])

    def Draft(self, request_iterator: Iterator[drafter_pb2.DraftRequest], context: object) -> Iterator[object]:
        for request in request_iterator:
            if request.WhichOneof("action") != "propose":
                continue
            max_nodes = request.propose.max_nodes
            if max_nodes == 0:
                yield drafter_pb2.DraftResponse()
                continue
            self.trees_sent += 1
            if self.mode == "out_of_vocabulary":
                tree = common_pb2.TokenTree(token_ids=[198, 10**6], parents=[-1, 0])
            elif self.mode == "oversized":
                tree = common_pb2.TokenTree(token_ids=[198] * (max_nodes + 8), parents=list(range(-1, max_nodes + 7)))
            else:  # parents after their children
                tree = common_pb2.TokenTree(token_ids=[198, 198], parents=[1, -1])
            yield drafter_pb2.DraftResponse(tree=tree)


@pytest.fixture(scope="module")
def bad_drafter_server() -> Iterator[tuple[BadDrafter, str]]:
    servicer = BadDrafter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def bad_drafter(
    cluster: LocalCluster, bad_drafter_server: tuple[BadDrafter, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[BadDrafter, str]]:
    """A second coordinator, on the same verifier, whose drafter sends malformed trees (a fresh circuit each)."""
    servicer, drafter_address = bad_drafter_server
    port = free_port()
    log = (tmp_path_factory.mktemp("bad-drafter") / "coordinator.log").open("ab")
    args = ["--port", str(port), "--verifier", cluster.verifier_address, "--model", cluster.model]
    # A backoff longer than the test: the requests after the first must all skip the drafter.
    args += ["--drafter", drafter_address, "--drafter-backoff-ms", "60000"]
    coordinator = subprocess.Popen([sys.executable, "-m", "coordinator", *args], stderr=log)
    try:
        wait_serving(f"127.0.0.1:{port}", 300, coordinator)
        yield servicer, f"127.0.0.1:{port}"
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=15)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("out_of_vocabulary", "outside the vocabulary [0, 49152)"),
        ("oversized", "accepts at most"),
        ("bad_parents", "parents must come before their children"),
    ],
)
def test_malformed_trees_are_caught_before_the_verifier_and_the_drafter_is_skipped(
    bad_drafter: tuple[BadDrafter, str], reference: list[int], mode: str, message: str
) -> None:
    servicer, address = bad_drafter
    servicer.mode = mode
    sent = servicer.trees_sent
    runs = [generate(address) for _ in range(2)]
    report(f"bad drafter: {mode}", runs, None)
    assert all(run.tokens == reference for run in runs)
    assert runs[0].stats.drafter_error.startswith("drafter dropped: sent a bad tree")
    assert message in runs[0].stats.drafter_error
    assert runs[0].stats.num_draft_tokens == 0
    assert runs[1].stats.drafter_error.startswith("drafter skipped"), runs[1].stats.drafter_error
    assert "sent a bad tree" in runs[1].stats.drafter_error
    assert servicer.trees_sent == sent + 1  # one bad tree per backoff period, not one per request
