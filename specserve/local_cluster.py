"""Run the three services as local processes on loopback: ``make run``, tests, benchmarks.

``python -m specserve.local_cluster`` starts a verifier, a drafter and a
coordinator, prints where each listens, and stops all three on Ctrl-C (or
when any of them exits).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.model_loading import DEFAULT_MODEL
from specserve.rpc import reconnect_options
from specserve.service_main import COORDINATOR_PORT, DRAFTER_PORT, HTTP_PORT, VERIFIER_PORT

PREDRAFT_ENV = "SPECSERVE_PREDRAFT_OUTCOMES"  # the drafter's --predraft-outcomes, set by whoever starts us


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_serving(
    address: str,
    timeout_s: float,
    *watched: subprocess.Popen[bytes],
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Block until the server at ``address`` reports SERVING on grpc.health.v1.

    Fails at once when any ``watched`` process exits (a crashed dependency
    would otherwise keep the server waiting until the timeout). ``credentials``:
    for a TLS server (health checks need no API key or token).
    """
    deadline = time.monotonic() + timeout_s
    # A server not yet listening refuses the connection, and gRPC's default backoff then waits up to two minutes
    # between attempts: this would time the backoff, not the start. Attempts at least every 0.3 s.
    options = reconnect_options(0.6)
    channel = (
        grpc.insecure_channel(address, options)
        if credentials is None
        else grpc.secure_channel(address, credentials, options)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for process in watched:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args!r} exited with code {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{address} did not become ready within {timeout_s:.0f} s")


def wait_http_ready(url: str, timeout_s: float, *watched: subprocess.Popen[bytes]) -> None:
    """Block until ``GET url`` (the coordinator's HTTP /health) answers 200; fail when a ``watched`` process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in watched:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args!r} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


@dataclass
class LocalCluster:
    """Verifier, drafter and coordinator as child processes (context manager)."""

    coordinator_port: int = COORDINATOR_PORT
    drafter_port: int = DRAFTER_PORT
    verifier_port: int = VERIFIER_PORT
    model: str = DEFAULT_MODEL
    redis_url: str | None = None
    with_drafter: bool = True
    # Verifier replicas: the first listens on verifier_port (process "verifier"), replica i on
    # extra_verifier_ports[i - 1] (process "verifier-i"; free ports when not given).
    num_verifiers: int = 1
    extra_verifier_ports: list[int] = field(default_factory=list)
    extra_verifier_args: list[str] = field(default_factory=list)
    extra_drafter_args: list[str] = field(default_factory=list)
    extra_coordinator_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None  # None: children log to this process's stderr
    # CPUs per service ("verifier", "drafter", "coordinator"): a benchmark's stand-in for separate machines.
    cpus: dict[str, frozenset[int]] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # TLS roots (and client certificate) to health-check a coordinator started with --tls-cert; None: plaintext.
    coordinator_credentials: grpc.ChannelCredentials | None = None
    # The coordinator's OpenAI-compatible HTTP API (--http-port); 0: off. Waited for (plaintext only) at start.
    http_port: int = 0

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    @property
    def http_base_url(self) -> str:
        """The OpenAI-compatible API's base URL (``base_url`` of the OpenAI client)."""
        if not self.http_port:
            raise RuntimeError("the HTTP API is off: start the cluster with an http_port")
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def drafter_address(self) -> str:
        return f"127.0.0.1:{self.drafter_port}"

    @property
    def verifier_address(self) -> str:
        return f"127.0.0.1:{self.verifier_port}"

    @property
    def verifier_addresses(self) -> dict[str, str]:
        """Each verifier replica's process name and address."""
        names = ["verifier", *(f"verifier-{i}" for i in range(1, self.num_verifiers))]
        ports = [self.verifier_port, *self.extra_verifier_ports]
        return {name: f"127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        stderr = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = (self.log_dir / f"{name}.log").open("ab")
        cpus = self.cpus.get(name)
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stderr=stderr,
            env=os.environ.copy(),
            # Set in the child before exec, so every thread it ever starts inherits it.
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
        self.processes[name] = process
        return process

    def start_drafter(self) -> None:
        args = ["--port", str(self.drafter_port)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        if self.drafter_shares_verifier_cpus and PREDRAFT_ENV not in os.environ:
            args += ["--predraft-outcomes", "0"]  # extra_drafter_args, after it, may turn it back on
        self._spawn("drafter", "draft_service", [*args, *self.extra_drafter_args])

    @property
    def drafter_shares_verifier_cpus(self) -> bool:
        """Whether the drafter may run on the verifier's CPUs (not pinned apart by ``cpus``).

        Pre-drafting drafts the next round while the verifier computes, which pays only on a core the
        verifier leaves idle; the verifier's step runs on every CPU it has, so on shared CPUs it takes the
        verifier's and every verify round waits for it (docs/benchmarks.md, "Pre-drafting on shared cores"). So a
        cluster on one machine starts its drafter with pre-drafting off.
        """
        drafter, verifier = self.cpus.get("drafter"), self.cpus.get("verifier")
        return drafter is None or verifier is None or bool(drafter & verifier)

    def start(self, timeout_s: float = 600.0) -> LocalCluster:
        while len(self.extra_verifier_ports) < self.num_verifiers - 1:
            self.extra_verifier_ports.append(free_port())
        for name, address in self.verifier_addresses.items():
            port = address.rpartition(":")[2]
            self._spawn(name, "target_service", ["--port", port, "--model", self.model, *self.extra_verifier_args])
        if self.with_drafter:
            self.start_drafter()
        self._spawn_coordinator()
        try:
            wait_serving(
                self.coordinator_address,
                timeout_s,
                *self.processes.values(),
                credentials=self.coordinator_credentials,
            )
            if self.http_port and self.coordinator_credentials is None:
                wait_http_ready(f"http://127.0.0.1:{self.http_port}/health", timeout_s, *self.processes.values())
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn_coordinator(self) -> None:
        verifiers = ",".join(self.verifier_addresses.values())  # the coordinator pins sessions to replicas
        coordinator_args = ["--port", str(self.coordinator_port), "--verifier", verifiers]
        coordinator_args += ["--model", self.model, "--drafter", self.drafter_address if self.with_drafter else ""]
        coordinator_args += ["--http-port", str(self.http_port)]
        self._spawn("coordinator", "coordinator", [*coordinator_args, *self.extra_coordinator_args])

    def restart_coordinator(self, timeout_s: float = 120.0) -> None:
        """Start a new coordinator against the running verifier (and drafter) after the last one exited."""
        old = self.processes.pop("coordinator", None)
        if old is not None and old.poll() is None:
            raise RuntimeError("the coordinator is still running: stop it first")
        self._spawn_coordinator()
        wait_serving(self.coordinator_address, timeout_s, *self.processes.values())
        if self.http_port and self.coordinator_credentials is None:
            wait_http_ready(f"http://127.0.0.1:{self.http_port}/health", timeout_s, *self.processes.values())

    def kill(self, name: str) -> None:
        """Kill one service abruptly (SIGKILL), as a crash would: "verifier-1" is the second verifier replica."""
        process = self.processes.pop(name)
        process.kill()
        process.wait()

    def stop(self) -> None:
        """SIGTERM each service (it drains), again after 5 s to those still draining (stop now), kill after 10."""
        for signum, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
            running = [process for process in self.processes.values() if process.poll() is None]
            for process in running:
                process.send_signal(signum)
            deadline = None if wait_s is None else time.monotonic() + wait_s
            for process in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run coordinator, drafter and verifier locally")
    parser.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL", DEFAULT_MODEL))
    parser.add_argument("--redis-url", default=os.environ.get("SPECSERVE_REDIS_URL") or None)
    parser.add_argument("--coordinator-port", type=int, default=COORDINATOR_PORT)
    parser.add_argument("--drafter-port", type=int, default=DRAFTER_PORT)
    parser.add_argument("--verifier-port", type=int, default=VERIFIER_PORT)
    parser.add_argument("--http-port", type=int, default=HTTP_PORT, help="the OpenAI-compatible HTTP API (0: off)")
    parser.add_argument(
        "--metrics-port-base",
        type=int,
        default=9100,
        help="Prometheus /metrics of the coordinator, drafter and verifier on base+1, +2, +3 (0: off)",
    )
    args = parser.parse_args(argv)
    cluster = LocalCluster(
        args.coordinator_port,
        args.drafter_port,
        args.verifier_port,
        model=args.model,
        redis_url=args.redis_url,
        http_port=args.http_port,
    )
    metrics = ""
    if args.metrics_port_base:
        ports = {name: args.metrics_port_base + i for i, name in enumerate(("coordinator", "drafter", "verifier"), 1)}
        cluster.extra_coordinator_args = ["--metrics-port", str(ports["coordinator"])]
        cluster.extra_drafter_args = ["--metrics-port", str(ports["drafter"])]
        cluster.extra_verifier_args = ["--metrics-port", str(ports["verifier"])]
        metrics = "metrics: " + ", ".join(f"{name} http://127.0.0.1:{port}/metrics" for name, port in ports.items())
        metrics += "\n"
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        http = f"OpenAI-compatible HTTP API: {cluster.http_base_url}\n" if args.http_port else ""
        print(
            f"specserve is up: coordinator {cluster.coordinator_address}, drafter {cluster.drafter_address}, "
            f"verifier {cluster.verifier_address} (n-gram pool: {args.redis_url or 'in-memory'})\n"
            f"{http}{metrics}"
            "auth is off: no API keys, no TLS, loopback only (docs/operations.md#privacy-model: how to turn it on)\n"
            'try:  specserve generate "Write a haiku about the sea"    (Ctrl-C stops all three)',
            flush=True,
        )
        while all(process.poll() is None for process in cluster.processes.values()):
            time.sleep(0.5)
        exited = [name for name, process in cluster.processes.items() if process.poll() is not None]
        print(f"{', '.join(exited)} exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping specserve", file=sys.stderr)
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
