"""Replicas of a tier as the Kubernetes API sees them: ``k8s://NAMESPACE/SERVICE:PORT`` targets.

A Service's EndpointSlices (``discovery.k8s.io/v1``, labelled ``kubernetes.io/service-name=SERVICE``) list
every pod behind it with three conditions: ``ready`` (take new work), ``serving`` (would be ready but for
terminating) and ``terminating`` (the pod is shutting down), and the zone of its node. The watch
(``coordinator.k8s_watch``) keeps an :class:`EndpointTable` of them up to date; the routers read it as
:class:`Replica` values:

- a ready endpoint that is not terminating is ``accepting``: it gets new sessions from the next one on;
- any other endpoint still listed (terminating, or not ready) keeps the sessions it holds but gets no new
  ones: a terminating verifier finishes its streams (that is what its drain is for);
- an endpoint no longer listed is gone: its sessions are re-prefilled elsewhere, as with DNS.

This module is pure data: no Kubernetes client, no gRPC, no threads.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

K8S_SCHEME = "k8s://"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# RFC 1123 labels (namespaces) and RFC 1035 labels (Service names), and IANA_SVC_NAME (port names).
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONDITIONS = ("ready", "serving", "terminating", "not_ready")


class TargetError(ValueError):
    """A ``k8s://`` target that cannot be watched; the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class K8sTarget:
    """``k8s://NAMESPACE/SERVICE:PORT``: PORT is the port's number on the pods or its name in the Service."""

    namespace: str
    service: str
    port: int | str

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    def __str__(self) -> str:
        return f"{K8S_SCHEME}{self.namespace}/{self.service}:{self.port}"


def is_k8s_target(target: str | None) -> bool:
    return bool(target) and str(target).startswith(K8S_SCHEME)


def parse_target(target: str) -> K8sTarget:
    """Parse ``k8s://NAMESPACE/SERVICE:PORT``; a TargetError names the part that is wrong."""
    expected = f"expected {K8S_SCHEME}NAMESPACE/SERVICE:PORT, e.g. {K8S_SCHEME}specserve/specserve-verifier:50053"
    if not target.startswith(K8S_SCHEME):
        raise TargetError(f"{target!r} is not a {K8S_SCHEME} target: {expected}")
    rest = target[len(K8S_SCHEME) :]
    namespace, slash, service_port = rest.partition("/")
    service, colon, port_text = service_port.rpartition(":")
    if not slash or not colon or not namespace or not service or not port_text:
        raise TargetError(f"{target!r} lacks a namespace, a service or a port: {expected}")
    if len(namespace) > 63 or not _DNS_LABEL.match(namespace):
        raise TargetError(f"{target!r}: namespace {namespace!r} is not a valid namespace name (RFC 1123 label)")
    if len(service) > 63 or not _SERVICE_NAME.match(service):
        raise TargetError(f"{target!r}: service {service!r} is not a valid Service name (RFC 1035 label)")
    port: int | str
    if port_text.isdigit():
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise TargetError(f"{target!r}: port {port} is outside 1-65535")
    elif len(port_text) <= 15 and _PORT_NAME.match(port_text) and not port_text.isdigit():
        port = port_text
    else:
        raise TargetError(f"{target!r}: port {port_text!r} is neither a number nor a port name")
    return K8sTarget(namespace, service, port)


@dataclass(frozen=True)
class Endpoint:
    """One pod address of a Service, as its EndpointSlice lists it (only what routing needs: bounded memory)."""

    address: str  # host:port, IPv6 in brackets
    ready: bool
    serving: bool
    terminating: bool
    zone: str = ""
    pod: str = ""

    @property
    def accepting(self) -> bool:
        """Whether new sessions may start here."""
        return self.ready and not self.terminating

    @property
    def condition(self) -> str:
        """One of CONDITIONS, for metrics and logs."""
        if self.accepting:
            return "ready"
        if self.terminating:
            return "terminating" if not self.serving else "serving"
        return "not_ready"


@dataclass(frozen=True)
class Replica:
    """A replica as the routers see it. DNS names and address lists give accepting replicas without a zone."""

    address: str
    accepting: bool = True
    zone: str = ""


def _port_of(raw: Mapping[str, Any], want: int | str) -> int | None:
    """The slice's port number for ``want`` (a name or a number), or None when the slice has no such port."""
    for port in raw.get("ports") or ():
        number = port.get("port")
        if number is None:
            continue
        if (isinstance(want, int) and number == want) or (isinstance(want, str) and port.get("name") == want):
            return int(number)
    return None


def endpoints_of_slice(raw: Mapping[str, Any], port: int | str) -> tuple[Endpoint, ...]:
    """The endpoints of one EndpointSlice (its JSON, as the API returns it) on ``port``.

    Conditions follow the API's rules for absent values: ``ready`` unset means ready, ``serving`` unset defers
    to ``ready``, ``terminating`` unset means not terminating.
    """
    number = _port_of(raw, port)
    if number is None:
        return ()
    address_type = raw.get("addressType", "IPv4")
    found = []
    for endpoint in raw.get("endpoints") or ():
        addresses = endpoint.get("addresses") or ()
        if not addresses:
            continue
        conditions = endpoint.get("conditions") or {}
        ready = conditions.get("ready") is not False
        serving = conditions.get("serving")
        serving = ready if serving is None else bool(serving)
        terminating = bool(conditions.get("terminating"))
        host = addresses[0]  # the API: consumers use the first address; the others are the same pod's
        address = f"[{host}]:{number}" if address_type == "IPv6" else f"{host}:{number}"
        pod = (endpoint.get("targetRef") or {}).get("name", "")
        found.append(Endpoint(address, ready, serving, terminating, endpoint.get("zone") or "", pod))
    return tuple(found)


def _better(a: Endpoint, b: Endpoint) -> Endpoint:
    """Of two slices listing one address (a pod moving between slices), the one that lets it do more."""
    rank = {"ready": 3, "serving": 2, "not_ready": 1, "terminating": 0}
    return a if rank[a.condition] >= rank[b.condition] else b


class EndpointTable:
    """The endpoints of one Service: per EndpointSlice name, merged by address on read."""

    def __init__(self, port: int | str) -> None:
        self._port = port
        self._slices: dict[str, tuple[Endpoint, ...]] = {}

    def replace(self, slices: Iterable[Mapping[str, Any]]) -> bool:
        """Replace everything with a fresh list's slices; whether the merged endpoints changed."""
        before = self.endpoints()
        self._slices = {_slice_name(raw): endpoints_of_slice(raw, self._port) for raw in slices}
        return self.endpoints() != before

    def apply(self, event_type: str, raw: Mapping[str, Any]) -> bool:
        """One watch event (ADDED, MODIFIED, DELETED); whether the merged endpoints changed."""
        before = self.endpoints()
        name = _slice_name(raw)
        if event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = endpoints_of_slice(raw, self._port)
        return self.endpoints() != before

    def endpoints(self) -> tuple[Endpoint, ...]:
        merged: dict[str, Endpoint] = {}
        for endpoints in self._slices.values():
            for endpoint in endpoints:
                known = merged.get(endpoint.address)
                merged[endpoint.address] = endpoint if known is None else _better(known, endpoint)
        return tuple(merged[a] for a in sorted(merged))


def _slice_name(raw: Mapping[str, Any]) -> str:
    return str((raw.get("metadata") or {}).get("name", ""))


@dataclass(frozen=True)
class EndpointSnapshot:
    """What the watch knows: ``version`` grows with each change; ``changed_at`` is when (monotonic) it learnt it."""

    version: int
    endpoints: tuple[Endpoint, ...]
    changed_at: float
    synced: bool  # a list has completed at least once

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(CONDITIONS, 0)
        for endpoint in self.endpoints:
            counts[endpoint.condition] += 1
        return counts


EMPTY_SNAPSHOT = EndpointSnapshot(0, (), 0.0, False)


class DiscoveryObserver(Protocol):
    """Where discovery reports (CoordinatorMetrics implements it)."""

    def discovery_replicas(self, tier: str, counts: Mapping[str, int]) -> None:
        """Endpoints known per condition, after each change."""

    def discovery_watch_restarted(self, tier: str, reason: str) -> None:
        """A watch ended and starts again: ``closed`` by the server, ``expired`` (410 Gone: relist), ``error``."""

    def discovery_acted(self, tier: str, seconds: float) -> None:
        """Time from an endpoint change reaching the coordinator to the router using the new set."""

    def discovery_first_session(self, tier: str, seconds: float) -> None:
        """Time from an endpoint becoming ready to the first new session routed to it."""


class NullObserver:
    def discovery_replicas(self, tier: str, counts: Mapping[str, int]) -> None:
        pass

    def discovery_watch_restarted(self, tier: str, reason: str) -> None:
        pass

    def discovery_acted(self, tier: str, seconds: float) -> None:
        pass

    def discovery_first_session(self, tier: str, seconds: float) -> None:
        pass


class WatchedReplicas:
    """A router's ``resolve`` over a watch's snapshots, timing how soon the router acts on each change.

    ``snapshot()`` is read on every routing decision (a plain attribute read of an immutable value the watch
    thread replaces), so a change is acted on by the next new session, with no refresh period.
    """

    def __init__(
        self,
        tier: str,
        snapshot: Callable[[], EndpointSnapshot],
        observer: DiscoveryObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self._snapshot = snapshot
        self._observer = observer or NullObserver()
        self._clock = clock
        self._version = -1
        self._replicas: tuple[Replica, ...] = ()
        self._accepting: set[str] = set()
        self._new_since: dict[str, float] = {}  # accepting addresses not yet given a session -> since when

    def __call__(self) -> Sequence[Replica]:
        snapshot = self._snapshot()
        if snapshot.version == self._version:
            return self._replicas
        self._version = snapshot.version
        self._replicas = tuple(Replica(e.address, e.accepting, e.zone) for e in snapshot.endpoints)
        accepting = {r.address for r in self._replicas if r.accepting}
        for address in accepting - self._accepting:
            self._new_since[address] = snapshot.changed_at
        for address in set(self._new_since) - accepting:
            del self._new_since[address]
        self._accepting = accepting
        if snapshot.changed_at:
            self._observer.discovery_acted(self.tier, max(0.0, self._clock() - snapshot.changed_at))
        return self._replicas

    def pinned(self, address: str) -> None:
        """A new session went to ``address``: the first one after it became ready is timed."""
        since = self._new_since.pop(address, None)
        if since is not None and since:
            self._observer.discovery_first_session(self.tier, max(0.0, self._clock() - since))


def describe_change(before: Sequence[Endpoint], after: Sequence[Endpoint]) -> str:
    """A log line's worth: which addresses came, went or changed condition."""
    old = {e.address: e for e in before}
    new = {e.address: e for e in after}
    parts = [f"+{a} ({new[a].condition}{', zone ' + new[a].zone if new[a].zone else ''})" for a in new if a not in old]
    parts += [f"-{a}" for a in old if a not in new]
    parts += [
        f"{a} {old[a].condition}->{new[a].condition}" for a in new if a in old and old[a].condition != new[a].condition
    ]
    return ", ".join(parts) or "no change"
