"""k8s:// discovery end to end: two real verifier processes behind the stand-in API server (tests/k8s_api.py).

The coordinator finds the verifiers only through the watched EndpointSlices (KUBECONFIG points it at the
stand-in). One slice per verifier, since the two listen on different loopback ports; the target names the
port (``:grpc``), so each slice gives its own number. Which verifier served a session is read from each
verifier's own metrics (prefills served).

- A second verifier turning ready gets the next new session (one event, no refresh period);
- the first marked terminating gets no new session while its running stream finishes there;
- the API server going away changes nothing for running or new generations;
- every output is token-identical to plain decoding.

The time from an endpoint event to the first session routed by it is printed (the coordinator's
``specserve_discovery_first_session_seconds``): run with ``-s`` to see it.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import wait_until
from tests.integration.conftest import FP32_VERIFIER, Target
from tests.k8s_api import FakeApiServer, Pod

pytestmark = pytest.mark.integration

SERVICE = "specserve-verifier"
MAX_NEW_TOKENS = 24
LONG_TOKENS = 96
PROMPT = "Explain in a few sentences why the sky is blue."
WITHIN_S = 30.0  # most a watched change may take to show in the coordinator's metrics on a loaded machine


def metric(port: int, name: str, labels: dict[str, str] | None = None) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def wait_metric(port: int, name: str, labels: dict[str, str], value: float) -> None:
    """Until the coordinator's metric shows the change: the watch thread applies it on its own time."""
    wait_until(lambda: metric(port, name, labels) == value, WITHIN_S, f"{name}{labels} reaches {value}", every_s=0.05)


class Setup:
    def __init__(self, cluster: LocalCluster, api: FakeApiServer, ports: list[int], metrics: list[int]) -> None:
        self.cluster = cluster
        self.api = api
        self.ports = ports  # the two verifiers' gRPC ports
        self.metrics = metrics  # their metrics ports, then the coordinator's

    def prefills(self, i: int) -> float:
        return metric(self.metrics[i], "specserve_verifier_request_queue_time_seconds_count", {"call": "prefill"})

    def slice(self, i: int, **conditions: bool) -> None:
        self.api.put(f"{SERVICE}-{i}", SERVICE, [Pod("127.0.0.1", f"verifier-{i}", **conditions)], self.ports[i])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    api = FakeApiServer()
    api.start()
    kubeconfig = tmp_path_factory.mktemp("kube") / "config"
    write_kubeconfig(kubeconfig, api.url)
    cluster = LocalCluster(free_port(), free_port(), free_port(), with_drafter=False)
    ports, metrics = [free_port(), free_port()], [free_port(), free_port(), free_port()]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KUBECONFIG", str(kubeconfig))
        env.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        try:
            for i in (0, 1):
                args = ["--port", str(ports[i]), "--metrics-port", str(metrics[i]), *FP32_VERIFIER, "--no-profile-cost"]
                cluster._spawn(f"verifier-{i}", "target_service", args)
            for i in (0, 1):
                wait_serving(f"127.0.0.1:{ports[i]}", 600, *cluster.processes.values())
            setup = Setup(cluster, api, ports, metrics)
            setup.slice(0)  # only the first verifier is in the Service so far
            coordinator = ["--port", str(cluster.coordinator_port), "--http-port", "0", "--drafter", ""]
            coordinator += ["--verifier", f"k8s://specserve/{SERVICE}:grpc", "--metrics-port", str(metrics[2])]
            cluster._spawn("coordinator", "coordinator", coordinator)
            wait_serving(cluster.coordinator_address, 300, *cluster.processes.values())
            yield setup
        finally:
            cluster.stop()
            api.stop()


def write_kubeconfig(path: Path, server: str) -> None:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters:\n- name: test\n  cluster:\n    server: {server}\n"
        "users:\n- name: test\n  user: {}\n"
        "contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: specserve\n"
    )


class Stream:
    """A generation in a thread; ``started`` is set at its first text."""

    def __init__(self, address: str, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
        self.max_new_tokens = max_new_tokens
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=PROMPT)])
        request = generation_pb2.GenerateRequest(chat=chat, max_new_tokens=self.max_new_tokens)
        try:
            with grpc.insecure_channel(address) as channel:
                for response in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=600):
                    if response.HasField("delta"):
                        self.tokens.extend(response.delta.token_ids)
                        self.started.set()
        except BaseException as exc:  # reported by result()
            self.error = exc
            self.started.set()

    def result(self) -> list[int]:
        self._thread.join(600)
        if self.error is not None:
            raise self.error
        return self.tokens


def test_scaling_draining_and_an_api_server_outage_take_effect_at_once(setup: Setup, target: Target) -> None:
    long = target.greedy(target.chat_ids(PROMPT), LONG_TOKENS)
    greedy = long[:MAX_NEW_TOKENS]
    address, coordinator_metrics = setup.cluster.coordinator_address, setup.metrics[2]
    ready = {"tier": "verifier", "condition": "ready"}

    first = Stream(address, LONG_TOKENS)  # on verifier 0, the only one; still streaming through the changes
    assert first.started.wait(600)
    assert (setup.prefills(0), setup.prefills(1)) == (1, 0)

    # Verifier 1 turns ready: one event, and the next new session goes there (verifier 0 holds a stream).
    first_session = "specserve_discovery_first_session_seconds"
    before = [metric(coordinator_metrics, f"{first_session}_{s}", {"tier": "verifier"}) for s in ("count", "sum")]
    setup.slice(1)
    wait_metric(coordinator_metrics, "specserve_discovery_replicas", ready, 2)
    second = Stream(address)
    assert second.started.wait(600)
    assert (setup.prefills(0), setup.prefills(1)) == (1, 1)
    after = [metric(coordinator_metrics, f"{first_session}_{s}", {"tier": "verifier"}) for s in ("count", "sum")]
    assert after[0] - before[0] == 1  # timed from the event that made verifier 1 ready
    print(f"\nendpoint event to the first session routed by it: {(after[1] - before[1]) * 1000:.1f} ms")

    # Verifier 0 terminates while still serving: every new session goes to verifier 1; its own stream finishes.
    setup.slice(0, ready=False, serving=True, terminating=True)
    wait_metric(coordinator_metrics, "specserve_discovery_replicas", ready, 1)
    later = [Stream(address) for _ in range(2)]
    assert first.result() == long and not first.error  # finished on the terminating verifier
    outputs = [second.result(), *(s.result() for s in later)]
    assert (setup.prefills(0), setup.prefills(1)) == (1, 3)

    # The API server goes away: running and new generations go on with the last known set.
    running = Stream(address)
    assert running.started.wait(600)
    setup.api.stop()
    outputs += [running.result(), Stream(address).result()]
    assert (setup.prefills(0), setup.prefills(1)) == (1, 5)
    assert all(output == greedy for output in outputs)  # token-identical to plain decoding (fp32, greedy)
    restarts = metric(coordinator_metrics, "specserve_discovery_watch_restarts_total", {"tier": "verifier"})
    assert restarts >= 1
