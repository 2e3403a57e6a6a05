"""List then watch a Service's EndpointSlices with the official ``kubernetes`` client, in a thread.

The protocol (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes):
list the slices (in pages of ``page_size``), note the list's ``metadata.resourceVersion``, then watch from it
(``watch=1&resourceVersion=RV&allowWatchBookmarks=true``). Each event (ADDED, MODIFIED, DELETED) carries the
slice and its new resourceVersion; BOOKMARK events carry only a resourceVersion, so a watch that resumes after
a quiet spell does not start from one the server has forgotten.

Surviving the API server:

- a watch the server ends (its ``timeoutSeconds``, a restart, a dropped connection, even mid-line) resumes
  from the last resourceVersion seen: no relist, no event lost or applied twice;
- an ERROR event with a 410 Gone Status (or an HTTP 410) means that resourceVersion was compacted away: the
  watch lists afresh and replaces the table only once the new list is complete, so routing never sees an
  empty set in between;
- an unreachable or failing API server is retried with a doubling backoff (``backoff_s`` up to
  ``max_backoff_s``) while the last known set stays in force: generation never fails for it.

Memory is bounded: slices are reduced to the few fields routing needs as they arrive (``EndpointTable``), the
list is read in pages, and a watch line longer than ``max_line_bytes`` ends the connection (then a relist).

The thread only replaces ``snapshot`` (an immutable value); the event loop reads it without locks.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from coordinator.discovery import (
    EMPTY_SNAPSHOT,
    DiscoveryObserver,
    Endpoint,
    EndpointSnapshot,
    EndpointTable,
    K8sTarget,
    NullObserver,
    describe_change,
)

log = logging.getLogger(__name__)

HTTP_GONE = 410
MAX_LINE_BYTES = 16 << 20
"""Longest watch event accepted. An EndpointSlice holds at most 1,000 endpoints (a few hundred KB of JSON)."""


class WatchExpired(Exception):
    """The resourceVersion the watch resumed from is too old (410 Gone): list again."""


class ApiServerError(Exception):
    """The API server refused or failed a list or watch; the message says what it answered."""


def api_client_from_environment() -> Any:
    """A ``kubernetes.client.ApiClient`` from the pod's service account, else from kubeconfig ($KUBECONFIG).

    Raises ApiServerError naming both places when neither is there (a start-up error for a k8s:// target).
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException as in_cluster:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as kubeconfig:
            raise ApiServerError(
                "k8s:// targets need the Kubernetes API: no service account token is mounted "
                f"({in_cluster}) and no kubeconfig was found ({kubeconfig}); run in a pod with "
                "automountServiceAccountToken (the chart's coordinator.discovery: kubernetes) or set KUBECONFIG"
            ) from kubeconfig
    return client.ApiClient()


class EndpointSliceWatch:
    """The EndpointSlices of one Service, kept current by list + watch in a daemon thread.

    ``step()`` does one list or one watch connection (tests drive it directly); ``run()`` loops it with the
    backoff until ``stop()``. ``wait`` waits for a backoff period and returns True once the watch is stopping
    (injected in tests, which then need no sleeps).
    """

    def __init__(
        self,
        target: K8sTarget,
        tier: str,
        api_client: Any,
        observer: DiscoveryObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        page_size: int = 500,
        watch_timeout_s: int = 300,
        connect_timeout_s: float = 5.0,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        from kubernetes import client

        self.target = target
        self.tier = tier
        self._api = client.DiscoveryV1Api(api_client)
        self._observer = observer or NullObserver()
        self._clock = clock
        self._stopping = threading.Event()
        self._wait = wait or self._stopping.wait
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._page_size = page_size
        self._watch_timeout_s = watch_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_line_bytes = max_line_bytes
        self._table = EndpointTable(target.port)
        self._changed = threading.Condition()
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self.snapshot: EndpointSnapshot = EMPTY_SNAPSHOT
        self.resource_version: str | None = None  # None: list next
        self.lists = 0  # completed lists (the first, and each relist)
        self.failures_in_a_row = 0

    # ---- the loop ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"k8s-watch-{self.tier}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the thread's read (urllib3 2.3+)
            except Exception:  # best effort: the thread is a daemon
                log.debug("closing the %s watch", self.tier, exc_info=True)
        with self._changed:
            self._changed.notify_all()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                progressed = self.step()
            except WatchExpired:
                log.info("%s watch of %s: resourceVersion expired (410 Gone); listing again", self.tier, self.target)
                self._restarted("expired")
                continue
            except Exception as exc:  # any failure: keep the last set, back off, retry
                if self._stopping.is_set():
                    return
                self.failures_in_a_row += 1
                delay = min(self._max_backoff_s, self._backoff_s * 2 ** (self.failures_in_a_row - 1))
                level = logging.WARNING if self.failures_in_a_row <= 3 else logging.DEBUG
                log.log(
                    level,
                    "%s watch of %s failed (%s); keeping the %d endpoints known, retrying in %.1f s",
                    self.tier,
                    self.target,
                    _brief(exc),
                    len(self.snapshot.endpoints),
                    delay,
                )
                self._restarted("error")
                if self._wait(delay):
                    return
                continue
            if self._stopping.is_set():
                return
            self._restarted("closed")
            if not progressed and self._wait(self._backoff_s):  # an empty watch: do not spin
                return

    def _restarted(self, reason: str) -> None:
        self._observer.discovery_watch_restarted(self.tier, reason)

    def step(self) -> bool:
        """One list (when no resourceVersion is known) or one watch connection, until the server ends it.

        Returns whether anything arrived. Raises WatchExpired on 410 Gone (the next step lists), anything else
        on failure.
        """
        try:
            if self.resource_version is None:
                self._list()
                return True
            return self._watch(self.resource_version)
        except Exception as exc:
            if getattr(exc, "status", None) == HTTP_GONE:  # an HTTP 410: an expired version or continue token
                self.resource_version = None
                raise WatchExpired(str(exc)) from exc
            raise

    def _list(self) -> None:
        slices: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = self._get_json(
                self._api.list_namespaced_endpoint_slice(
                    self.target.namespace,
                    label_selector=self.target.label_selector,
                    limit=self._page_size,
                    _continue=token,
                    _preload_content=False,
                    _request_timeout=(self._connect_timeout_s, 60.0),
                )
            )
            # Keep only what the table needs of each slice as the pages come: a page is dropped once read.
            slices.extend(_compact(raw) for raw in page.get("items") or ())
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                break
        received = self._clock()
        before = self._table.endpoints()
        changed = self._table.replace(slices)
        self.resource_version = str(metadata.get("resourceVersion") or "0")
        self.lists += 1
        self.failures_in_a_row = 0
        self._publish(before, changed or not self.snapshot.synced, received, "list")

    def _watch(self, resource_version: str) -> bool:
        # _preload_content=False: the raw urllib3 response (the client's type hints name the parsed list).
        response: Any = self._api.list_namespaced_endpoint_slice(
            self.target.namespace,
            label_selector=self.target.label_selector,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            # Reads may pause between events; the server ends the watch after timeout_seconds anyway.
            _request_timeout=(self._connect_timeout_s, self._watch_timeout_s + 30.0),
        )
        self._response = response
        progressed = False
        try:
            for line in _lines(response, self._max_line_bytes):
                event = json.loads(line)
                self._event(event)
                progressed = True
                self.failures_in_a_row = 0
                if self._stopping.is_set():
                    break
        finally:
            self._response = None
            response.release_conn()
        return progressed

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        raw = event.get("object") or {}
        if kind == "ERROR":
            code = raw.get("code")
            if code == HTTP_GONE:
                self.resource_version = None
                raise WatchExpired(raw.get("message", ""))
            raise ApiServerError(f"watch ERROR event: {code} {raw.get('reason', '')}: {raw.get('message', '')}")
        version = (raw.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if version:
                self.resource_version = str(version)
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise ApiServerError(f"unexpected watch event type {kind!r}")
        received = self._clock()
        before = self._table.endpoints()
        changed = self._table.apply(kind, _compact(raw))
        if version:
            self.resource_version = str(version)
        if changed:
            self._publish(before, True, received, kind.lower())

    def _publish(self, before: tuple[Endpoint, ...], changed: bool, received: float, cause: str) -> None:
        if not changed:
            return
        endpoints = self._table.endpoints()
        self.snapshot = EndpointSnapshot(self.snapshot.version + 1, endpoints, received, True)
        counts = self.snapshot.counts()
        self._observer.discovery_replicas(self.tier, counts)
        log.info(
            "%s endpoints of %s (%s): %s; now %s",
            self.tier,
            self.target,
            cause,
            describe_change(before, endpoints),
            ", ".join(f"{n} {c}" for c, n in counts.items() if n) or "none",
        )
        with self._changed:
            self._changed.notify_all()

    # ---- waiting (tests, start-up) ----

    def wait_for(self, predicate: Callable[[EndpointSnapshot], bool], timeout_s: float) -> bool:
        """Block until ``predicate(snapshot)`` holds (True) or ``timeout_s`` passes or the watch stops (False)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.snapshot):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping.is_set():
                    return False
                self._changed.wait(remaining)
        return True

    def _get_json(self, response: Any) -> dict[str, Any]:
        try:
            data = response.read()
        finally:
            response.release_conn()
        parsed: dict[str, Any] = json.loads(data)
        return parsed


def own_zone(api_client: Any, namespace: str, service: str, pod: str) -> str | None:
    """The zone of ``pod``'s entry in ``service``'s EndpointSlices; None while the pod is not listed there."""
    from kubernetes import client

    response: Any = client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False
    )
    try:
        listing = json.loads(response.read())
    finally:
        response.release_conn()
    for raw in listing.get("items") or ():
        for endpoint in raw.get("endpoints") or ():
            if (endpoint.get("targetRef") or {}).get("name") == pod:
                return str(endpoint.get("zone") or "")
    return None


def _compact(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of an EndpointSlice that routing reads; the rest (managedFields, owners, hints) is dropped."""
    return {
        "metadata": {"name": (raw.get("metadata") or {}).get("name", "")},
        "addressType": raw.get("addressType"),
        "ports": raw.get("ports"),
        "endpoints": [
            {
                "addresses": (e.get("addresses") or [])[:1],
                "conditions": e.get("conditions"),
                "zone": e.get("zone"),
                "targetRef": {"name": (e.get("targetRef") or {}).get("name", "")},
            }
            for e in raw.get("endpoints") or ()
        ],
    }


def _lines(response: Any, max_line_bytes: int) -> Iterator[bytes]:
    """Complete newline-terminated lines of a watch stream; a partial last line (a cut connection) is dropped."""
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=True):
        buffer.extend(chunk)
        start = 0
        while (end := buffer.find(b"\n", start)) != -1:
            line = bytes(buffer[start:end]).strip()
            start = end + 1
            if line:
                yield line
        del buffer[:start]
        if len(buffer) > max_line_bytes:
            raise ApiServerError(f"a watch event longer than {max_line_bytes} bytes")


def _brief(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
