"""EndpointSlice discovery and least-loaded routing, against recorded API objects.

The fixtures are `kubectl get endpointslices -o json` output of a release named
"specserve" (five drafter pods over two slices: three ready, one still loading
its model, one terminating), the IPv6 slice of a dual-stack drafter Service, and
a `kubectl get endpointslices -w --output-watch-events -o json` stream.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from coordinator.endpointslice_discovery import (
    Endpoint,
    LeastLoadedRouter,
    TierEndpoints,
    endpoints_of_slice,
    follow,
    least_loaded,
    watch_endpoint_slices,
)

FIXTURES = Path(__file__).parent / "fixtures"
DRAFTER_SERVICE = "specserve-drafter"
POD = "specserve-drafter-6d9f8b7c4-"


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture
def slices() -> dict[str, dict[str, Any]]:
    """The recorded slices of every Service in the namespace, by slice name."""
    return {item["metadata"]["name"]: item for item in load("endpointslices-specserve.json")["items"]}


@pytest.fixture
def events() -> list[dict[str, Any]]:
    return load("endpointslice-watch-drafter.json")


def pods(endpoints: frozenset[Endpoint]) -> set[str]:
    return {e.pod.removeprefix(POD) for e in endpoints}


def test_fixtures_are_valid_endpointslices(slices: dict[str, dict[str, Any]], events: list[dict[str, Any]]) -> None:
    recorded = [*slices.values(), load("endpointslice-drafter-ipv6.json"), *(e["object"] for e in events)]
    for endpoint_slice in recorded:
        kubernetes_validate.validate(endpoint_slice, "1.33.0", strict=True)


def test_a_slice_yields_only_ready_endpoints_on_the_grpc_port(slices: dict[str, dict[str, Any]]) -> None:
    ready = endpoints_of_slice(slices["specserve-drafter-7xk2p"])
    assert ready == {
        Endpoint(pod=POD + "2xqlm", address="10.42.1.17:50052"),
        Endpoint(pod=POD + "9kz7w", address="10.42.2.9:50052"),
    }, "tq5rn is not ready (model still loading) and must be left out"


def test_terminating_endpoints_take_no_new_sessions(slices: dict[str, dict[str, Any]]) -> None:
    # zp2wd is terminating but still `serving`: it finishes its calls, gets no new session.
    assert pods(endpoints_of_slice(slices["specserve-drafter-m4bqs"])) == {"hv8cd"}
    # On a Service with publishNotReadyAddresses a terminating pod stays `ready`;
    # `terminating` alone must keep it out.
    endpoint_slice = copy.deepcopy(slices["specserve-drafter-m4bqs"])
    endpoint_slice["endpoints"][1]["conditions"]["ready"] = True
    assert pods(endpoints_of_slice(endpoint_slice)) == {"hv8cd"}


def test_an_unknown_ready_condition_counts_as_ready(slices: dict[str, dict[str, Any]]) -> None:
    endpoint_slice = copy.deepcopy(slices["specserve-drafter-7xk2p"])
    del endpoint_slice["endpoints"][2]["conditions"]["ready"]
    assert "tq5rn" in pods(endpoints_of_slice(endpoint_slice))


def test_a_slice_without_the_named_port_yields_nothing(slices: dict[str, dict[str, Any]]) -> None:
    assert endpoints_of_slice(slices["specserve-drafter-7xk2p"], port_name="http") == frozenset()
    assert pods(endpoints_of_slice(slices["specserve-drafter-7xk2p"], port_name="metrics")) == {"2xqlm", "9kz7w"}


def test_a_tier_merges_its_slices_and_ignores_other_services(slices: dict[str, dict[str, Any]]) -> None:
    tier = TierEndpoints(DRAFTER_SERVICE)
    assert tier.replace_all(slices.values()) is True
    assert pods(tier.endpoints) == {"2xqlm", "9kz7w", "hv8cd"}
    assert all(e.address.endswith(":50052") for e in tier.endpoints)

    verifier = TierEndpoints("specserve-verifier")
    verifier.replace_all(slices.values())
    assert verifier.endpoints == {Endpoint(pod="specserve-verifier-5c7b9d8f6-lx4vn", address="10.42.7.4:50053")}


def test_a_dual_stack_tier_counts_each_pod_once() -> None:
    ipv6_slice = load("endpointslice-drafter-ipv6.json")
    assert TierEndpoints(DRAFTER_SERVICE).apply("ADDED", ipv6_slice) is False

    tier = TierEndpoints(DRAFTER_SERVICE, address_type="IPv6")
    assert tier.apply("ADDED", ipv6_slice) is True
    assert {e.address for e in tier.endpoints} == {"[fd00:10:42:1::17]:50052", "[fd00:10:42:2::9]:50052"}


def test_watch_events_add_update_and_remove_endpoints(events: list[dict[str, Any]]) -> None:
    tier = TierEndpoints(DRAFTER_SERVICE)
    seen = [(tier.apply(e["type"], e["object"]), pods(tier.endpoints)) for e in events]
    assert seen == [
        (True, {"2xqlm", "9kz7w"}),  # ADDED slice 7xk2p
        (True, {"2xqlm", "9kz7w", "hv8cd"}),  # ADDED slice m4bqs
        (True, {"2xqlm", "9kz7w", "hv8cd", "tq5rn"}),  # MODIFIED: tq5rn loaded its model
        (False, {"2xqlm", "9kz7w", "hv8cd", "tq5rn"}),  # MODIFIED: terminating zp2wd dropped from the slice
        (True, {"2xqlm", "9kz7w", "tq5rn"}),  # DELETED slice m4bqs
    ]


def test_events_of_other_services_and_bookmarks_are_ignored(slices: dict[str, dict[str, Any]]) -> None:
    tier = TierEndpoints(DRAFTER_SERVICE)
    assert tier.apply("ADDED", slices["specserve-verifier-q9d5t"]) is False
    assert tier.apply("BOOKMARK", {"kind": "EndpointSlice", "metadata": {"resourceVersion": "2292100"}}) is False
    assert tier.endpoints == frozenset()


def test_new_sessions_go_to_the_least_loaded_drafter(slices: dict[str, dict[str, Any]]) -> None:
    tier = TierEndpoints(DRAFTER_SERVICE)
    tier.replace_all(slices.values())
    router = LeastLoadedRouter()

    chosen = [router.route(f"s{i}", tier.endpoints) for i in range(6)]
    # Ties go to the smallest pod name, so the order is deterministic.
    assert [e.pod.removeprefix(POD) for e in chosen if e] == ["2xqlm", "9kz7w", "hv8cd"] * 2
    assert sorted(router.load().values()) == [2, 2, 2]

    # A session keeps its drafter.
    assert router.route("s0", tier.endpoints) == chosen[0]

    # Freeing two sessions on 9kz7w makes it the least loaded.
    router.release("s1")
    router.release("s4")
    assert router.route("s6", tier.endpoints) == chosen[1]


def test_sessions_of_a_deleted_drafter_move_to_the_least_loaded_one(
    slices: dict[str, dict[str, Any]], events: list[dict[str, Any]]
) -> None:
    tier = TierEndpoints(DRAFTER_SERVICE)
    tier.replace_all(slices.values())
    router = LeastLoadedRouter()
    before = {s: router.route(s, tier.endpoints) for s in ("a", "b", "c", "d")}
    assert pods(frozenset(e for e in before.values() if e)) == {"2xqlm", "9kz7w", "hv8cd"}

    deleted = events[-1]
    assert deleted["type"] == "DELETED"
    tier.apply(deleted["type"], deleted["object"])  # slice m4bqs with hv8cd goes away

    after = {s: router.route(s, tier.endpoints) for s in before}
    assert after["c"] is not None and after["c"].pod == POD + "9kz7w"  # c was on hv8cd; 9kz7w had 1 session
    assert {s: after[s] for s in ("a", "b", "d")} == {s: before[s] for s in ("a", "b", "d")}


def test_no_ready_drafter_routes_nowhere() -> None:
    router = LeastLoadedRouter()
    assert router.route("s", frozenset()) is None
    assert router.load() == {}


def test_least_loaded_prefers_fewer_sessions_over_name_order() -> None:
    a, b = Endpoint("pod-a", "10.0.0.1:1"), Endpoint("pod-b", "10.0.0.2:1")
    assert least_loaded([b, a], {}) == a
    assert least_loaded([a, b], {a: 3, b: 1}) == b
    assert least_loaded([], {}) is None


def test_follow_lists_watches_and_relists_after_an_expired_watch(
    slices: dict[str, dict[str, Any]], events: list[dict[str, Any]]
) -> None:
    added_a, added_b, modified_a, modified_b, deleted_b = (e["object"] for e in events)
    listings = iter([([added_a], "100"), ([modified_a, modified_b], "200")])
    watched_from: list[str] = []
    stop = threading.Event()
    snapshots: list[set[str]] = []

    def list_slices() -> tuple[list[Any], str]:
        return next(listings)

    def stream_events(version: str) -> Iterator[dict[str, Any]]:
        watched_from.append(version)
        if len(watched_from) == 1:
            yield {"type": "ADDED", "object": added_b}
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
        elif len(watched_from) == 2:
            yield {"type": "DELETED", "object": deleted_b}
        else:  # resumed after the stream ended: nothing more happens
            stop.set()
            yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "300"}}}

    tier = TierEndpoints(DRAFTER_SERVICE)
    follow(tier, list_slices, stream_events, stop, on_change=lambda e: snapshots.append(pods(e)))

    # The first watch starts at the LIST's version; after the 410 the tier is
    # listed again; after a watch that simply ends it resumes from the last event.
    assert watched_from == ["100", "200", deleted_b["metadata"]["resourceVersion"]]
    assert snapshots == [
        {"2xqlm", "9kz7w"},
        {"2xqlm", "9kz7w", "hv8cd"},
        {"2xqlm", "9kz7w", "hv8cd", "tq5rn"},
        {"2xqlm", "9kz7w", "tq5rn"},
    ]


def test_follow_survives_api_errors_and_keeps_the_last_endpoints(slices: dict[str, dict[str, Any]]) -> None:
    drafter_slices = [s for name, s in slices.items() if name.startswith(DRAFTER_SERVICE + "-")]
    calls = 0
    stop = threading.Event()
    tier = TierEndpoints(DRAFTER_SERVICE)

    def list_slices() -> tuple[list[Any], str]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("API server unreachable")
        return drafter_slices, str(calls)

    def stream_events(version: str) -> Iterator[dict[str, Any]]:
        if calls == 1:
            raise ConnectionError("watch connection reset")
        stop.set()
        return iter(())

    follow(tier, list_slices, stream_events, stop, retry_delay_s=0)
    assert calls == 3
    assert pods(tier.endpoints) == {"2xqlm", "9kz7w", "hv8cd"}


class FakeApiServer:
    """Just enough of the Kubernetes API on loopback for LIST and WATCH of EndpointSlices.

    Each GET is answered by the next scripted response: ("list", items, resourceVersion)
    or ("watch", events). Watch events go out as newline-delimited JSON, as the
    API server streams them. Requests are recorded for the assertions.
    """

    def __init__(self, script: list[tuple[Any, ...]]) -> None:
        import http.server

        self.script = list(script)
        self.requests: list[dict[str, list[str]]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlparse

                url = urlparse(self.path)
                assert url.path == "/apis/discovery.k8s.io/v1/namespaces/specserve/endpointslices", url.path
                fake.requests.append(parse_qs(url.query))
                step = fake.script.pop(0) if fake.script else ("watch", [])
                if step[0] == "list":
                    body = json.dumps(
                        {
                            "apiVersion": "discovery.k8s.io/v1",
                            "kind": "EndpointSliceList",
                            "items": step[1],
                            "metadata": {"resourceVersion": step[2]},
                        }
                    ).encode()
                else:
                    body = b"".join(json.dumps(e).encode() + b"\n" for e in step[1])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_watch_endpoint_slices_through_the_kubernetes_client(
    slices: dict[str, dict[str, Any]], events: list[dict[str, Any]]
) -> None:
    kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is an optional dependency")
    added_a, added_b, modified_a, _, _ = (e["object"] for e in events)
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired"}
    expired = {"type": "ERROR", "object": status | {"message": "too old resource version: 100 (2291900)"}}
    script = [
        ("list", [added_a], "100"),
        ("watch", [{"type": "ADDED", "object": added_b}, {"type": "MODIFIED", "object": modified_a}]),
        ("watch", [expired]),
        ("list", [modified_a], "2292500"),  # slice m4bqs went away while the watch was expired
    ]
    stop = threading.Event()
    snapshots: list[set[str]] = []

    def on_change(endpoints: frozenset[Endpoint]) -> None:
        snapshots.append(pods(endpoints))
        if len(snapshots) == 4:
            stop.set()

    fake = FakeApiServer(script)
    with fake as host:
        api_client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=host))
        tier = TierEndpoints(DRAFTER_SERVICE)
        worker = threading.Thread(
            target=watch_endpoint_slices, args=(tier, "specserve", stop, on_change, 5, api_client), daemon=True
        )
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "the watch did not stop"

    assert snapshots == [
        {"2xqlm", "9kz7w"},
        {"2xqlm", "9kz7w", "hv8cd"},
        {"2xqlm", "9kz7w", "hv8cd", "tq5rn"},
        {"2xqlm", "9kz7w", "tq5rn"},
    ]
    # LIST, WATCH from the LIST's version, WATCH resumed from the last event, LIST after the 410.
    assert [(r.get("watch"), r.get("resourceVersion")) for r in fake.requests[:4]] == [
        (None, None),
        (["true"], ["100"]),
        (["true"], [modified_a["metadata"]["resourceVersion"]]),
        (None, None),
    ]
    assert all(r["labelSelector"] == ["kubernetes.io/service-name=specserve-drafter"] for r in fake.requests)
