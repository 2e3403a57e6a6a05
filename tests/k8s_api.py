"""A stand-in Kubernetes API server for EndpointSlices: the real list/watch protocol over HTTP/1.1.

No API server can run on the test machines, so this one speaks just enough of it for ``discovery.k8s.io/v1``
EndpointSlices in one namespace, the way kube-apiserver does:

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=S``
  answers an ``EndpointSliceList`` (``metadata.resourceVersion``; ``limit`` and ``continue`` pages);
- ``...&watch=1&resourceVersion=RV&allowWatchBookmarks=true`` answers 200 with a chunked stream of
  newline-separated ``{"type": ..., "object": ...}`` events after RV: ADDED, MODIFIED, DELETED, BOOKMARK;
  a RV older than the compacted history gets an ERROR event holding a 410 ``Status`` (``Expired``);
- the test can drop watches (mid-line too), compact the history and take the whole server down and up.

Objects are shaped as the API returns them (``endpoint_slice``); tests validate them with kubernetes-validate.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class Pod:
    """One endpoint of a slice: a pod's address and conditions."""

    ip: str
    name: str
    ready: bool = True
    serving: bool | None = None  # None: as ready
    terminating: bool = False
    zone: str = "zone-a"


def endpoint_slice(
    name: str, namespace: str, service: str, pods: list[Pod], port: int, resource_version: int
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it and the API returns it."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "generateName": f"{service}-",
            "namespace": namespace,
            "uid": f"00000000-0000-4000-8000-{abs(hash(name)) % 10**12:012d}",
            "resourceVersion": str(resource_version),
            "generation": resource_version,
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                SERVICE_LABEL: service,
                "app.kubernetes.io/component": service.rsplit("-", 1)[-1],
            },
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": service,
                    "uid": "00000000-0000-4000-8000-000000000001",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod.ip],
                "conditions": {
                    "ready": pod.ready,
                    "serving": pod.ready if pod.serving is None else pod.serving,
                    "terminating": pod.terminating,
                },
                "nodeName": f"node-{pod.zone}",
                "targetRef": {
                    "kind": "Pod",
                    "namespace": namespace,
                    "name": pod.name,
                    "uid": f"00000000-0000-4000-8000-{abs(hash(pod.name)) % 10**12:012d}",
                },
                "zone": pod.zone,
            }
            for pod in pods
        ],
        "ports": [
            {"name": "grpc", "protocol": "TCP", "port": port, "appProtocol": "kubernetes.io/h2c"},
            {"name": "metrics", "protocol": "TCP", "port": 9090, "appProtocol": "http"},
        ],
    }


def gone_status(old: int, oldest: int) -> dict[str, Any]:
    """The Status kube-apiserver sends in an ERROR event when a watch asks for a compacted resourceVersion."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {old} ({oldest})",
        "reason": "Expired",
        "code": 410,
    }


class FakeApiServer:
    """EndpointSlices of one namespace, with a resourceVersion history to watch from."""

    def __init__(self, namespace: str = "specserve", port: int = 0) -> None:
        self.namespace = namespace
        self._lock = threading.Condition()
        self._version = 100
        self._slices: dict[str, dict[str, Any]] = {}
        self._history: list[tuple[int, str, dict[str, Any]]] = []  # (resourceVersion, type, object)
        self._oldest = 0  # watches from before this are answered 410
        self._generation = 0  # drop() ends the watches of older generations
        self._cut_next_line = False
        self.close_when_idle = False  # a watch ends once it has sent everything (tests that step the watch)
        self.requests: list[dict[str, list[str]]] = []
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._down = False

    # ---- life ----

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        owner = self

        class Handler(_Handler):
            server_owner = owner

        server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        server.daemon_threads = True
        self._port = server.server_address[1]
        self._server = server
        self._down = False
        threading.Thread(target=server.serve_forever, name="fake-k8s-api", daemon=True).start()

    def stop(self) -> None:
        """The API server goes away: no new connections, open watches end."""
        with self._lock:
            self._down = True
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- what tests change ----

    def _record(self, kind: str, obj: dict[str, Any]) -> int:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._history.append((self._version, kind, obj))
        self._lock.notify_all()
        return self._version

    def put(self, name: str, service: str, pods: list[Pod], port: int) -> int:
        """Create or replace a slice (ADDED or MODIFIED); returns its resourceVersion."""
        with self._lock:
            kind = "MODIFIED" if name in self._slices else "ADDED"
            obj = endpoint_slice(name, self.namespace, service, pods, port, self._version + 1)
            self._slices[name] = obj
            return self._record(kind, obj)

    def delete(self, name: str) -> int:
        with self._lock:
            obj = self._slices.pop(name)
            return self._record("DELETED", json.loads(json.dumps(obj)))

    def bookmark(self) -> int:
        """A BOOKMARK: the resourceVersion moves on (other objects changed) without a slice event."""
        with self._lock:
            self._version += 5
            bookmark = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1"}
            bookmark["metadata"] = {"resourceVersion": str(self._version)}  # type: ignore[assignment]
            self._history.append((self._version, "BOOKMARK", bookmark))
            self._lock.notify_all()
            return self._version

    def compact(self) -> None:
        """Forget the history: watches from any version seen so far get 410 Gone."""
        with self._lock:
            self._version += 1
            self._oldest = self._version
            self._history = [h for h in self._history if h[0] >= self._oldest]

    def drop(self, mid_line: bool = False) -> None:
        """End the open watches (after half of the next event's line, with ``mid_line``)."""
        with self._lock:
            if mid_line:
                self._cut_next_line = True
            else:
                self._generation += 1
            self._lock.notify_all()

    def watch_requests(self) -> list[dict[str, list[str]]]:
        return [r for r in self.requests if r.get("watch") in (["1"], ["true"])]

    def list_requests(self) -> list[dict[str, list[str]]]:
        return [r for r in self.requests if r.get("watch") not in (["1"], ["true"])]

    # ---- serving (handler threads) ----

    def _matching(self, selector: str, obj: dict[str, Any]) -> bool:
        if not selector:
            return True
        key, _, value = selector.partition("=")
        labels = obj["metadata"].get("labels") or {}
        return bool(labels.get(key) == value)

    def list_page(self, selector: str, limit: int, start: int) -> dict[str, Any]:
        with self._lock:
            items = [json.loads(json.dumps(o)) for n, o in sorted(self._slices.items()) if self._matching(selector, o)]
            version = self._version
        for item in items:  # a list's items carry no kind/apiVersion
            item.pop("kind")
            item.pop("apiVersion")
        page = items[start : start + limit] if limit else items[start:]
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if limit and start + limit < len(items):
            metadata["continue"] = f"{version}:{start + limit}"
        return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": metadata, "items": page}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_owner: FakeApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        api = self.server_owner
        url = urlparse(self.path)
        query = parse_qs(url.query)
        api.requests.append(query)
        if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices":
            self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
            return
        selector = (query.get("labelSelector") or [""])[0]
        if (query.get("watch") or [""])[0] in ("1", "true"):
            self._watch(api, selector, int((query.get("resourceVersion") or ["0"])[0]))
            return
        limit = int((query.get("limit") or ["0"])[0])
        token = (query.get("continue") or [""])[0]
        start = int(token.split(":")[1]) if token else 0
        self._json(200, api.list_page(selector, limit, start))

    def _json(self, code: int, body: dict[str, Any]) -> None:
        self.close_connection = True
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, api: FakeApiServer, selector: str, since: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        # Each watch on its own connection, so taking the server down leaves no pooled connection to it.
        self.send_header("Connection", "close")
        self.end_headers()
        cursor = since
        with api._lock:
            generation = api._generation
        try:
            while True:
                with api._lock:
                    if since < api._oldest:
                        event = {"type": "ERROR", "object": gone_status(since, api._oldest)}
                        pending = [(since, json.dumps(event).encode() + b"\n")]
                        ending = True
                    else:
                        pending = [
                            (rv, json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                            for rv, kind, obj in api._history
                            if rv > cursor and (kind == "BOOKMARK" or api._matching(selector, obj))
                        ]
                        ending = False
                    while not pending and not ending:
                        if api._down or api._generation != generation:
                            break
                        if api.close_when_idle:
                            break
                        api._lock.wait(0.5)
                        pending = [
                            (rv, json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                            for rv, kind, obj in api._history
                            if rv > cursor and (kind == "BOOKMARK" or api._matching(selector, obj))
                        ]
                    cut = api._cut_next_line and bool(pending)
                    if cut:
                        api._cut_next_line = False
                    stop = api._down or api._generation != generation
                if cut:
                    line = pending[0][1]
                    self._chunk(line[: len(line) // 2])
                    self._abort()
                    return
                for rv, line in pending:
                    self._chunk(line)
                    cursor = max(cursor, rv)
                if ending or stop or (api.close_when_idle and not pending) or (not pending):
                    if stop and api._down:
                        self._abort()
                        return
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    self.close_connection = True
                    return
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _abort(self) -> None:
        """Cut the connection without ending the chunked body: a dropped connection."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
