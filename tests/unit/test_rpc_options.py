"""Client channels and servers agree: no server closes a connection for the pings its clients send."""

from specserve.rpc import channel_options, server_options


def test_servers_accept_the_keepalive_pings_that_clients_send() -> None:
    client = dict(channel_options())
    server = dict(server_options())
    # A server strikes pings closer than this while no data flows and GOAWAYs after two strikes (default 5 min).
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
