"""Client channels and servers agree: no server closes a connection for the pings its clients send; the drafter
channel reconnects within the circuit breaker's probe interval."""

import asyncio

import pytest

import coordinator.main as coordinator_main
from coordinator.config import CoordinatorConfig
from coordinator.ports import VerifierInfo
from specserve.rpc import channel_options, reconnect_options, server_options


def test_servers_accept_the_keepalive_pings_that_clients_send() -> None:
    client = dict(channel_options())
    server = dict(server_options())
    # A server strikes pings closer than this while no data flows and GOAWAYs after two strikes (default 5 min).
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]


def test_the_drafter_channel_reconnects_at_least_twice_per_probe_interval() -> None:
    """gRPC's defaults (1 s growing 1.6x to 120 s, 20 s per attempt) kept a restarted drafter away for 20 s."""
    for probe_interval_s in (0.1, 3.0, 5.0, 60.0):
        options = dict(reconnect_options(probe_interval_s))
        bound_ms = options["grpc.max_reconnect_backoff_ms"]
        # With gRPC's 20% jitter an attempt still comes within the probe interval.
        assert 1.2 * bound_ms <= max(probe_interval_s * 1000, 200)
        assert options["grpc.initial_reconnect_backoff_ms"] <= bound_ms
        assert options["grpc.min_reconnect_backoff_ms"] <= bound_ms


VERIFIER = VerifierInfo(
    "m", "fp", vocab_size=8, max_tree_nodes=8, max_tree_depth=8, max_session_tokens=64, supports_branching=True
)


def test_the_coordinator_gives_its_drafter_channel_the_bounded_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple[str, object]]] = []

    def channel(target: str, tls: object, options: list[tuple[str, object]]) -> object:
        seen.append(options)
        raise RuntimeError("stop here")

    monkeypatch.setattr(coordinator_main, "aio_channel", channel)
    config = CoordinatorConfig(drafter="127.0.0.1:1", drafter_backoff_ms=4000)
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(coordinator_main.connect_drafter(config, "fp", VERIFIER))
    assert dict(seen[0])["grpc.max_reconnect_backoff_ms"] == 2000
