"""k8s:// discovery: the EndpointSlice watch against a stand-in API server (tests/k8s_api.py), and the routers.

Most tests drive the watch one step at a time (one list, or one watch connection that the server ends once it
has sent what it has), so the order of events is the test's own; the one test of the background thread
injects the backoff wait and hands out each period itself. No sleeps.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client

from coordinator.discovery import (
    Endpoint,
    EndpointSnapshot,
    K8sTarget,
    Replica,
    TargetError,
    WatchedReplicas,
    parse_target,
)
from coordinator.drafter_pool import DrafterPool
from coordinator.k8s_watch import EndpointSliceWatch, WatchExpired
from coordinator.verifier_router import StickyVerifierRouter
from specserve.errors import DrafterFailed
from specserve.results import DraftFeedback, DraftReply
from specserve.sampling import GREEDY, SamplingParams
from specserve.token_tree import TokenTree
from specserve.verify_call import SessionPrefill, VerifyCall
from tests.k8s_api import FakeApiServer, Pod, endpoint_slice, gone_status
from tests.unit.test_verifier_router import FakeReplica

SERVICE = "specserve-verifier"
PORT = 50053
TARGET = K8sTarget("specserve", SERVICE, PORT)


class Observer:
    def __init__(self) -> None:
        self.replicas: list[dict[str, int]] = []
        self.restarts: list[str] = []
        self.acted: list[float] = []
        self.first_sessions: list[float] = []

    def discovery_replicas(self, tier: str, counts: Mapping[str, int]) -> None:
        self.replicas.append(dict(counts))

    def discovery_watch_restarted(self, tier: str, reason: str) -> None:
        self.restarts.append(reason)

    def discovery_acted(self, tier: str, seconds: float) -> None:
        self.acted.append(seconds)

    def discovery_first_session(self, tier: str, seconds: float) -> None:
        self.first_sessions.append(seconds)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.close_when_idle = True
    server.start()
    yield server
    server.stop()


def api_client(server: FakeApiServer) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = server.url
    return client.ApiClient(configuration)


def watch_of(server: FakeApiServer, **kwargs: Any) -> EndpointSliceWatch:
    return EndpointSliceWatch(TARGET, "verifier", api_client(server), **kwargs)


def conditions(watch: EndpointSliceWatch) -> dict[str, str]:
    return {e.address: e.condition for e in watch.snapshot.endpoints}


# ---------------------------------------------------------------- fixtures --


@pytest.mark.parametrize("version", ["1.33.0", "1.37.0"])
def test_the_stand_in_serves_endpoint_slices_shaped_as_the_api_does(version: str) -> None:
    pods = [Pod("10.0.0.1", "v-1"), Pod("10.0.0.2", "v-2", ready=False, serving=True, terminating=True)]
    kubernetes_validate.validate(endpoint_slice("v-abc", "specserve", SERVICE, pods, PORT, 7), version, strict=True)
    server = FakeApiServer()
    server.put("v-abc", SERVICE, pods, PORT)
    listing = server.list_page(f"kubernetes.io/service-name={SERVICE}", 0, 0)
    kubernetes_validate.validate(listing, version, strict=True)
    assert listing["metadata"]["resourceVersion"] and len(listing["items"]) == 1
    # The bundled schemas file Status under meta/v1 while the wire says v1, so validate() cannot find it: check
    # the fields against that schema's.
    status_schema = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/status-meta-v1.json", version
    )
    assert set(gone_status(1, 2)) <= set(status_schema["properties"])


# ------------------------------------------------------------------ target --


def test_k8s_targets_parse_and_bad_ones_say_what_is_wrong() -> None:
    assert parse_target("k8s://specserve/specserve-verifier:50053") == TARGET
    assert parse_target("k8s://prod/drafter:grpc").port == "grpc"
    for bad, words in [
        ("k8s://specserve-verifier:50053", "lacks a namespace"),
        ("k8s://ns/svc", "lacks a namespace, a service or a port"),
        ("k8s://NS/svc:1", "namespace 'NS'"),
        ("k8s://ns/9svc:1", "service '9svc'"),
        ("k8s://ns/svc:70000", "outside 1-65535"),
        ("k8s://ns/svc:bad_port!", "neither a number nor a port name"),
        ("dns:///svc:1", "not a k8s:// target"),
    ]:
        with pytest.raises(TargetError, match=words):
            parse_target(bad)


# ------------------------------------------------------------------- watch --


def test_pods_join_become_ready_go_not_ready_and_terminate(api: FakeApiServer) -> None:
    observer = Observer()
    watch = watch_of(api, observer=observer)
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a")], PORT)
    api.put("other", "specserve-drafter", [Pod("10.0.9.9", "d-a")], 50052)  # another Service's slice
    watch.step()  # the list
    assert conditions(watch) == {"10.0.0.1:50053": "ready"}
    assert watch.snapshot.synced and watch.lists == 1
    listed_at = watch.resource_version

    a, b = "10.0.0.1:50053", "10.0.0.2:50053"
    steps = [
        ([Pod("10.0.0.1", "v-a"), Pod("10.0.0.2", "v-b", ready=False)], {a: "ready", b: "not_ready"}),
        ([Pod("10.0.0.1", "v-a"), Pod("10.0.0.2", "v-b")], {a: "ready", b: "ready"}),
        ([Pod("10.0.0.1", "v-a", ready=False), Pod("10.0.0.2", "v-b")], {a: "not_ready", b: "ready"}),
        # Terminating, still serving: keeps its sessions, gets no new ones.
        ([Pod("10.0.0.1", "v-a", ready=False, serving=True, terminating=True), Pod("10.0.0.2", "v-b")],
         {a: "serving", b: "ready"}),
        ([Pod("10.0.0.1", "v-a", ready=False, serving=False, terminating=True), Pod("10.0.0.2", "v-b")],
         {a: "terminating", b: "ready"}),
        ([Pod("10.0.0.2", "v-b")], {b: "ready"}),  # gone
    ]  # fmt: skip
    for pods, expected in steps:
        version = api.put("v-1", SERVICE, pods, PORT)
        assert watch.step()
        assert conditions(watch) == expected
        assert watch.resource_version == str(version)
    assert list(conditions(watch)) == ["10.0.0.2:50053"]
    assert [e.accepting for e in watch.snapshot.endpoints] == [True]
    first_watch = api.watch_requests()[0]
    assert first_watch["resourceVersion"] == [listed_at]
    assert first_watch["allowWatchBookmarks"] == ["true"]
    assert first_watch["labelSelector"] == [f"kubernetes.io/service-name={SERVICE}"]
    assert watch.lists == 1  # every change came by the watch
    assert observer.replicas[-1] == {"ready": 1, "serving": 0, "terminating": 0, "not_ready": 0}

    api.delete("v-1")
    watch.step()
    assert watch.snapshot.endpoints == ()


def test_a_watch_dropped_mid_event_resumes_from_the_last_version_without_a_relist(api: FakeApiServer) -> None:
    watch = watch_of(api)
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a")], PORT)
    watch.step()
    before = watch.resource_version
    snapshot = watch.snapshot
    api.drop(mid_line=True)  # the next event's line is cut in half, then the connection
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a"), Pod("10.0.0.2", "v-b")], PORT)
    with pytest.raises(Exception):  # noqa: B017  (urllib3's protocol error, whatever its class)
        watch.step()
    assert watch.snapshot is snapshot and watch.resource_version == before  # half an event is no event
    watch.step()  # resumes where it was
    assert len(watch.snapshot.endpoints) == 2
    assert watch.lists == 1
    assert [r["resourceVersion"] for r in api.watch_requests()] == [[before], [before]]


def test_bookmarks_move_the_resource_version_without_a_change(api: FakeApiServer) -> None:
    watch = watch_of(api)
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a")], PORT)
    watch.step()
    snapshot = watch.snapshot
    version = api.bookmark()
    assert watch.step()
    assert watch.resource_version == str(version)
    assert watch.snapshot is snapshot
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a", ready=False)], PORT)
    watch.step()
    assert api.watch_requests()[-1]["resourceVersion"] == [str(version)]


def test_410_gone_forces_a_relist_and_the_known_set_stays_until_it_is_complete(api: FakeApiServer) -> None:
    watch = watch_of(api)
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a")], PORT)
    watch.step()
    api.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a"), Pod("10.0.0.2", "v-b")], PORT)
    api.compact()  # the change above is lost to a watch; only a list shows it
    with pytest.raises(WatchExpired):
        watch.step()
    assert list(conditions(watch)) == ["10.0.0.1:50053"]  # kept meanwhile
    assert watch.resource_version is None
    watch.step()
    assert watch.lists == 2
    assert list(conditions(watch)) == ["10.0.0.1:50053", "10.0.0.2:50053"]


def test_large_lists_come_in_pages(api: FakeApiServer) -> None:
    for i in range(5):
        api.put(f"v-{i}", SERVICE, [Pod(f"10.0.1.{i}", f"v-{i}")], PORT)
    watch = watch_of(api, page_size=2)
    watch.step()
    assert len(watch.snapshot.endpoints) == 5
    pages = api.list_requests()
    assert [r.get("limit") for r in pages] == [["2"]] * 3
    assert [bool(r.get("continue")) for r in pages] == [False, True, True]


def test_an_api_server_down_for_a_while_leaves_the_known_set_in_force() -> None:
    """The background loop: failures back off (doubling) and keep the set; the watch resumes once it is back."""
    server = FakeApiServer()
    server.start()
    server.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a")], PORT)
    asked: queue.Queue[float] = queue.Queue()
    answers: queue.Queue[bool] = queue.Queue()

    def wait(seconds: float) -> bool:
        asked.put(seconds)
        return answers.get(timeout=30)

    observer = Observer()
    watch = watch_of(server, wait=wait, observer=observer, backoff_s=0.5, max_backoff_s=2.0)
    watch.start()
    try:
        assert watch.wait_for(lambda s: len(s.endpoints) == 1, 30)
        server.stop()
        delays = []
        for _ in range(4):
            delays.append(asked.get(timeout=30))
            assert list(conditions(watch)) == ["10.0.0.1:50053"]  # generation goes on with what was known
            if len(delays) < 4:
                answers.put(False)
        assert delays == [0.5, 1.0, 2.0, 2.0]
        server.start()  # back, on the same port, with a change made meanwhile
        server.put("v-1", SERVICE, [Pod("10.0.0.1", "v-a"), Pod("10.0.0.2", "v-b")], PORT)
        answers.put(False)
        assert watch.wait_for(lambda s: len(s.endpoints) == 2, 30)
        assert watch.lists == 1  # resumed from its resourceVersion: the history was still there
        assert observer.restarts.count("error") == 4
    finally:
        watch.stop()
        answers.put(True)
        server.stop()


# ----------------------------------------------------------------- routers --


class Snapshots:
    """A watch's snapshot as the routers read it, changed by the test."""

    def __init__(self) -> None:
        self.snapshot = EndpointSnapshot(0, (), 0.0, True)

    def set(self, at: float, *endpoints: Endpoint) -> None:
        self.snapshot = EndpointSnapshot(self.snapshot.version + 1, endpoints, at, True)


def ready(address: str, zone: str = "a") -> Endpoint:
    return Endpoint(address, True, True, False, zone)


def terminating(address: str, zone: str = "a") -> Endpoint:
    return Endpoint(address, False, True, True, zone)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_verifier_router_acts_on_each_change_at_the_next_session() -> None:
    snapshots, clock, observer = Snapshots(), Clock(), Observer()
    source = WatchedReplicas("verifier", lambda: snapshots.snapshot, observer, clock)
    replicas: dict[str, FakeReplica] = {}
    router = StickyVerifierRouter(
        source, lambda a: replicas.setdefault(a, FakeReplica(a)), refresh_s=0.0, clock=clock, on_pin=source.pinned
    )

    async def run() -> None:
        clock.now = 1.0
        snapshots.set(1.0, ready("10.0.0.1:1"))
        await router.prefill(SessionPrefill("s1", (1,), SamplingParams()))
        # A second replica turns ready: the very next new session goes there (it has none).
        snapshots.set(10.0, ready("10.0.0.1:1"), ready("10.0.0.2:1"))
        clock.now = 10.25
        await router.prefill(SessionPrefill("s2", (1,), SamplingParams()))
        assert ("prefill", "s2") in replicas["10.0.0.2:1"].calls
        # The first starts terminating: its session finishes there, every new one goes to the second.
        snapshots.set(20.0, terminating("10.0.0.1:1"), ready("10.0.0.2:1"))
        clock.now = 20.5
        for i in range(3):
            await router.prefill(SessionPrefill(f"n{i}", (1,), SamplingParams()))
        await router.verify(VerifyCall("s1", 1))
        assert [c for c in replicas["10.0.0.1:1"].calls if c[0] == "prefill"] == [("prefill", "s1")]
        assert ("verify", "s1") in replicas["10.0.0.1:1"].calls
        # Gone: its session moves (a NOT_FOUND there makes the round loop re-prefill it).
        snapshots.set(30.0, ready("10.0.0.2:1"))
        await router.verify(VerifyCall("s1", 1))
        assert ("verify", "s1") in replicas["10.0.0.2:1"].calls

    asyncio.run(run())
    assert observer.first_sessions == [0.0, 0.25]  # from the event that made each replica ready
    assert observer.acted[:3] == [0.0, 0.25, 0.5]


class FakeStream:
    wants_features = False
    takes_verified_trees = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.closed = False

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        return DraftReply(TokenTree(), 0)

    async def close(self) -> None:
        self.closed = True


class FakeDrafter:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sessions: list[str] = []
        self.closed = False

    async def info(self) -> Any:
        return None

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], fingerprint: str, sampling: SamplingParams = GREEDY
    ) -> FakeStream:
        self.sessions.append(session_id)
        return FakeStream()

    async def aclose(self) -> None:
        self.closed = True


def test_drafter_sessions_prefer_the_own_zone_spread_by_open_streams_and_fall_back_to_any() -> None:
    listed: list[Replica] = [
        Replica("10.0.0.1:2", zone="a"),
        Replica("10.0.0.2:2", zone="a"),
        Replica("10.0.0.3:2", zone="b"),
    ]
    drafters: dict[str, FakeDrafter] = {}
    pool = DrafterPool(lambda: tuple(listed), lambda a: drafters.setdefault(a, FakeDrafter(a)), zone="a")

    async def run() -> None:
        streams = [await pool.open(f"s{i}", [1], "fp") for i in range(4)]
        assert pool.streams == {"10.0.0.1:2": 2, "10.0.0.2:2": 2}  # zone a only, spread evenly
        await streams[0].close()
        await pool.open("s4", [1], "fp")
        assert drafters["10.0.0.1:2"].sessions[-1] == "s4"  # the one with fewer open streams
        # Zone a's drafters terminate (they finish their streams): new sessions go to zone b.
        listed[0] = Replica("10.0.0.1:2", accepting=False, zone="a")
        listed[1] = Replica("10.0.0.2:2", accepting=False, zone="a")
        await pool.open("s5", [1], "fp")
        assert drafters["10.0.0.3:2"].sessions == ["s5"]
        # One of them leaves the slice: its connection closes once its last stream has ended.
        del listed[1]
        await pool.open("s6", [1], "fp")
        assert not drafters["10.0.0.2:2"].closed
        for stream in (streams[1], streams[3]):  # the two on 10.0.0.2
            await stream.close()
        await asyncio.sleep(0)  # the close task runs
        assert drafters["10.0.0.2:2"].closed
        listed.clear()
        with pytest.raises(DrafterFailed, match="no drafter endpoint takes new sessions"):
            await pool.open("s7", [1], "fp")

    asyncio.run(run())
