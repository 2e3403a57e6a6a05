"""SIGTERM mid-stream: the stream finishes unchanged, new work is refused, the process exits by itself after it.

Real processes, one cluster for the file: first the coordinator is drained (and restarted alone against the
running verifier), then the verifier. Timings are printed, not asserted: that the process stopped because its
last stream ended, not because the grace ran out, is read from its log. The grace is long (a loaded 2-core
machine has taken 28 s for the rest of a 48-token stream) so that the stream always ends by itself.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.local_cluster import LocalCluster, free_port
from specserve.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import FP32_VERIFIER, Target

pytestmark = pytest.mark.integration

GRACE_S = 120.0
EXIT_GUARD_S = GRACE_S + 60  # only turns a process that never exits into a failure
# The signal is handled on the server's event loop at its next turn; health's Watch says NOT_SERVING once it is
# (within this, only a guard against a server that never says it).
NOT_SERVING_WITHIN_S = 30.0
MAX_NEW_TOKENS = 48
PROMPT = "Explain in a few sentences why the sky is blue."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        free_port(), free_port(), free_port(), with_drafter=False, log_dir=tmp_path_factory.mktemp("drain-logs")
    )
    grace = ["--shutdown-grace-s", str(GRACE_S)]
    # No drafter, so no draft budgets: skip measuring the cost curve (minutes on a busy machine).
    cluster.extra_verifier_args = [*FP32_VERIFIER, "--no-profile-cost", *grace]
    cluster.extra_coordinator_args = grace
    with cluster as c:
        yield c


@pytest.fixture(scope="module")
def greedy(target: Target) -> list[int]:
    return target.greedy(target.chat_ids(PROMPT), MAX_NEW_TOKENS)


def request(max_new_tokens: int = MAX_NEW_TOKENS) -> generation_pb2.GenerateRequest:
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=PROMPT)])
    return generation_pb2.GenerateRequest(chat=chat, max_new_tokens=max_new_tokens)


def wait_not_serving(address: str, within_s: float = NOT_SERVING_WITHIN_S) -> float:
    """Watch health until it says NOT_SERVING (the server pushes each change); the seconds it took."""
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=within_s)
        statuses: list[int] = []
        try:
            for reply in watch:
                statuses.append(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    return time.monotonic() - start
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise
        finally:
            watch.cancel()
    raise AssertionError(f"{address} reported only {statuses} within {within_s} s of SIGTERM, never NOT_SERVING")


def last_stop_line(cluster: LocalCluster, name: str) -> str:
    """The last line in which ``name`` logged why it stopped (``specserve.rpc``: drained, grace over, or forced)."""
    assert cluster.log_dir is not None
    log = (cluster.log_dir / f"{name}.log").read_text(errors="replace")
    return next((line for line in reversed(log.splitlines()) if "specserve.rpc: stopping" in line), "")


def drain_mid_stream(cluster: LocalCluster, name: str, health_address: str) -> list[int]:
    """Stream, SIGTERM ``name`` after the first chunk, check the drain; the tokens streamed."""
    process = cluster.processes[name]
    with grpc.insecure_channel(cluster.coordinator_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stream = stub.Generate(request(), timeout=120)
        first = next(stream)
        tokens = list(first.delta.token_ids)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        not_serving = wait_not_serving(health_address)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request(max_new_tokens=4), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        details = refused.value.details() or ""
        assert "shutting down" in details
        for internal in ("127.0.0.1", "verifier at", "debug_error_string", "StatusCode"):  # the log has those
            assert internal not in details, details
        assert process.poll() is None, f"the {name} waits for the stream in flight"

        stats = None
        for response in stream:
            if response.HasField("delta"):
                tokens += response.delta.token_ids
            else:
                stats = response.stats
        streamed = time.monotonic() - signalled
    assert stats is not None and stats.num_generated_tokens == len(tokens)
    try:
        process.wait(timeout=EXIT_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {name} did not exit within {EXIT_GUARD_S:.0f} s of its last stream")
    exited = time.monotonic() - signalled
    assert process.returncode == 0
    assert last_stop_line(cluster, name).endswith("stopping: drained"), "it waited out the grace, not its stream"
    print(
        f"{name}: NOT_SERVING {not_serving:.2f} s after SIGTERM, stream done after {streamed:.2f} s, "
        f"exited after {exited:.2f} s (grace {GRACE_S:.0f} s)"
    )
    return tokens


def test_a_draining_coordinator_finishes_its_stream_and_refuses_new_ones(
    cluster: LocalCluster, greedy: list[int]
) -> None:
    tokens = drain_mid_stream(cluster, "coordinator", cluster.coordinator_address)
    assert tokens == greedy


def test_a_draining_verifier_serves_the_sessions_it_holds_to_the_end(cluster: LocalCluster, greedy: list[int]) -> None:
    cluster.restart_coordinator()
    tokens = drain_mid_stream(cluster, "verifier", cluster.verifier_address)
    assert tokens == greedy
