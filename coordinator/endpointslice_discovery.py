"""Drafter discovery from Kubernetes EndpointSlices, and least-loaded routing.

By default the coordinator reaches drafters through the headless Service's DNS
name and lets gRPC's round_robin policy spread calls. In a cluster it can
instead watch the Service's EndpointSlices (``discovery.k8s.io/v1``): it then
knows every ready drafter pod by name and can pin each new session to the
drafter with the fewest sessions, so a session's draft state stays in one pod.

Vocabulary used below:

- endpoint: one ready pod of a tier, dialled at ``address`` (``host:port``).
- load: the number of live sessions *this* coordinator has pinned to an
  endpoint. Other coordinators' sessions are invisible to it; with several
  coordinators each balances its own share, which is what round-robin
  front-ends give them anyway.

Everything here is plain data manipulation on the dicts the API server returns
(exactly what ``kubectl get endpointslices -o json`` prints), so it is tested
against recorded objects. Only :func:`watch_endpoint_slices` talks to the API
server, and it imports the ``kubernetes`` client itself.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

ApiObject = Mapping[str, Any]
#: Returns the current slices of the tier and the list's resourceVersion.
ListSlices = Callable[[], tuple[list[ApiObject], str]]
#: Yields watch events (``{"type": ..., "object": ...}``) from a resourceVersion on.
StreamEvents = Callable[[str], Iterable[ApiObject]]
OnChange = Callable[[frozenset["Endpoint"]], None]


@dataclass(frozen=True, order=True)
class Endpoint:
    """One ready pod of a tier."""

    pod: str
    address: str  # "host:port"; IPv6 hosts in brackets, ready for a gRPC target


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (HTTP 410 Gone): list again."""


def _host_port(host: str, port: int, address_type: str) -> str:
    return f"[{host}]:{port}" if address_type == "IPv6" else f"{host}:{port}"


def _is_ready(endpoint: ApiObject) -> bool:
    # The API says a missing `ready` means unknown and should be read as ready;
    # a terminating pod takes no new sessions even while it still serves.
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def _port_number(endpoint_slice: ApiObject, port_name: str) -> int | None:
    ports = endpoint_slice.get("ports") or []
    for port in ports:
        if port.get("name", "") == port_name and port.get("port") is not None:
            return int(port["port"])
    return None


def endpoints_of_slice(endpoint_slice: ApiObject, port_name: str = "grpc") -> frozenset[Endpoint]:
    """Ready, non-terminating endpoints of one EndpointSlice, on the named port.

    A slice without that port (or whose ports are not known yet) contributes
    nothing. Of an endpoint's addresses only the first is used: the API defines
    them as fungible.
    """
    port = _port_number(endpoint_slice, port_name)
    if port is None:
        return frozenset()
    address_type = endpoint_slice.get("addressType", "IPv4")
    found = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if not addresses or not _is_ready(endpoint):
            continue
        address = _host_port(addresses[0], port, address_type)
        target = endpoint.get("targetRef") or {}
        pod = target.get("name") if target.get("kind") == "Pod" else None
        found.add(Endpoint(pod=pod or endpoint.get("hostname") or address, address=address))
    return frozenset(found)


class TierEndpoints:
    """The ready endpoints of one Service, merged over all of its EndpointSlices.

    A Service may be split over several slices, and a pod may briefly appear in
    two while the controller moves it, so endpoints are kept per slice (by
    slice name) and the tier's set is their union. A dual-stack Service has
    slices per address family; only ``address_type`` ones count, so each pod is
    one endpoint. Safe to update from a watch thread while other threads read
    :attr:`endpoints`.
    """

    def __init__(self, service: str, port_name: str = "grpc", address_type: str = "IPv4") -> None:
        self.service = service
        self.port_name = port_name
        self.address_type = address_type
        self._by_slice: dict[str, frozenset[Endpoint]] = {}
        self._endpoints: frozenset[Endpoint] = frozenset()
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> frozenset[Endpoint]:
        """A snapshot of the current ready endpoints."""
        return self._endpoints

    def _owns(self, endpoint_slice: ApiObject) -> bool:
        labels = endpoint_slice.get("metadata", {}).get("labels") or {}
        return labels.get(SERVICE_NAME_LABEL) == self.service and endpoint_slice.get("addressType") == self.address_type

    def replace_all(self, slices: Iterable[ApiObject]) -> bool:
        """Reset to the slices of a fresh LIST; returns whether the endpoints changed."""
        by_slice = {s["metadata"]["name"]: endpoints_of_slice(s, self.port_name) for s in slices if self._owns(s)}
        with self._lock:
            self._by_slice = by_slice
            return self._publish()

    def apply(self, event_type: str, endpoint_slice: ApiObject) -> bool:
        """Apply one ADDED/MODIFIED/DELETED watch event; returns whether the endpoints changed.

        Events for other Services' slices, other address families and other
        event types (BOOKMARK) are ignored.
        """
        if event_type not in ("ADDED", "MODIFIED", "DELETED") or not self._owns(endpoint_slice):
            return False
        name = endpoint_slice["metadata"]["name"]
        with self._lock:
            if event_type == "DELETED":
                self._by_slice.pop(name, None)
            else:
                self._by_slice[name] = endpoints_of_slice(endpoint_slice, self.port_name)
            return self._publish()

    def _publish(self) -> bool:
        merged = frozenset().union(*self._by_slice.values())
        changed = merged != self._endpoints
        self._endpoints = merged
        return changed


def least_loaded(endpoints: Iterable[Endpoint], load: Mapping[Endpoint, int]) -> Endpoint | None:
    """The endpoint with the fewest sessions; ties go to the smallest (pod, address)."""
    return min(endpoints, key=lambda e: (load.get(e, 0), e.pod, e.address), default=None)


class LeastLoadedRouter:
    """Pins sessions to endpoints, giving each new session the least-loaded one.

    A session keeps its endpoint while that endpoint stays ready. When it goes
    away (pod deleted, not ready, terminating) the session is moved to the
    least-loaded endpoint on its next call; the new drafter rebuilds its state
    from the committed tokens, so nothing is lost.
    """

    def __init__(self) -> None:
        self._pinned: dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    def load(self) -> Counter[Endpoint]:
        """Sessions pinned to each endpoint."""
        with self._lock:
            return Counter(self._pinned.values())

    def route(self, session_id: str, endpoints: Collection[Endpoint]) -> Endpoint | None:
        """The endpoint for ``session_id`` among the ready ``endpoints``; None when there is none."""
        with self._lock:
            current = self._pinned.get(session_id)
            if current is not None and current in endpoints:
                return current
            chosen = least_loaded(endpoints, Counter(self._pinned.values()))
            if chosen is None:
                self._pinned.pop(session_id, None)
            else:
                self._pinned[session_id] = chosen
            return chosen

    def release(self, session_id: str) -> None:
        """Forget a finished session, freeing its share of the endpoint's load."""
        with self._lock:
            self._pinned.pop(session_id, None)


def follow(
    tier: TierEndpoints,
    list_slices: ListSlices,
    stream_events: StreamEvents,
    stop: threading.Event,
    on_change: OnChange | None = None,
    retry_delay_s: float = 1.0,
) -> None:
    """Keep ``tier`` current until ``stop`` is set: LIST once, then follow WATCH events.

    A watch that ends is resumed from the last resourceVersion seen. An expired
    watch (an ERROR event or :class:`WatchExpired`) starts over with a LIST, and
    so does any other failure, after ``retry_delay_s``: losing the API server
    must not kill discovery, and the last known endpoints stay in use meanwhile.
    """

    def changed() -> None:
        if on_change is not None:
            on_change(tier.endpoints)

    version: str | None = None
    while not stop.is_set():
        try:
            if version is None:
                slices, version = list_slices()
                if tier.replace_all(slices):
                    changed()
            for event in stream_events(version):
                if event["type"] == "ERROR":
                    raise WatchExpired(str(event.get("object")))
                obj = event["object"]
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if tier.apply(event["type"], obj):
                    changed()
                if stop.is_set():
                    return
        except WatchExpired:
            log.info("watch of %s EndpointSlices expired; listing again", tier.service)
            version = None
        except Exception:
            log.exception("watching %s EndpointSlices failed; retrying", tier.service)
            version = None
            stop.wait(retry_delay_s)


def watch_endpoint_slices(
    tier: TierEndpoints,
    namespace: str,
    stop: threading.Event,
    on_change: OnChange | None = None,
    watch_timeout_s: int = 300,
    api_client: Any = None,
) -> None:
    """Follow the tier's EndpointSlices through the Kubernetes API; blocks until ``stop``.

    Needs ``get``, ``list`` and ``watch`` on ``discovery.k8s.io`` endpointslices
    in ``namespace`` (the Helm chart's coordinator Role when
    ``coordinator.discovery.mode=endpointslices``). Run it in a thread. Without
    ``api_client`` (a ``kubernetes.client.ApiClient``) it uses the pod's
    in-cluster ServiceAccount.
    """
    from kubernetes import client, config, watch
    from kubernetes.client.exceptions import ApiException

    if api_client is None:
        config.load_incluster_config()
    api = client.DiscoveryV1Api(api_client)
    selector = f"{SERVICE_NAME_LABEL}={tier.service}"

    def list_slices() -> tuple[list[ApiObject], str]:
        # Raw JSON rather than client models: the same dicts as a watch event's
        # raw_object. Without preloading, the call returns the HTTP response.
        response: Any = api.list_namespaced_endpoint_slice(namespace, label_selector=selector, _preload_content=False)
        listing = json.loads(response.data)
        return listing.get("items") or [], listing["metadata"]["resourceVersion"]

    def stream_events(version: str) -> Iterator[ApiObject]:
        try:
            for event in watch.Watch().stream(
                api.list_namespaced_endpoint_slice,
                namespace,
                label_selector=selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=watch_timeout_s,
            ):
                yield {"type": event["type"], "object": event["raw_object"]}
        except ApiException as error:
            if error.status == 410:
                raise WatchExpired(str(error)) from error
            raise

    follow(tier, list_slices, stream_events, stop, on_change)
