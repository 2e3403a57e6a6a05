"""uvicorn embedded in the coordinator's loop (coordinator.openai_api.serve): TLS, mTLS, signals left alone, stop."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
from pathlib import Path

import httpx2 as httpx
import pytest

from coordinator.openai_api.app import create_app
from coordinator.openai_api.serve import HttpServer, HttpStartError
from specserve.auth.tls import ServerTLS
from tests.integration.test_auth_tls import Pki, make_pki
from tests.unit.test_openai_api import FakeFrontend

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(pki: Pki, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if with_certificate:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def test_plaintext_serves_leaves_signals_to_the_coordinator_and_stops() -> None:
    async def scenario() -> None:
        before = [signal.getsignal(s) for s in SIGNALS]
        server = HttpServer(create_app(FakeFrontend()), "127.0.0.1", 0)
        await server.start()
        assert [signal.getsignal(s) for s in SIGNALS] == before  # uvicorn installed no handler of its own
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"http://127.0.0.1:{server.port}/v1/completions", json={"model": "smollm2", "prompt": "a"}
            )
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hello world"
        port = server.port
        await server.stop()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass

    asyncio.run(scenario())


def test_tls_and_client_certificates(pki: Pki) -> None:
    async def scenario() -> None:
        tls = ServerTLS(str(pki.server_cert), str(pki.server_key))
        server = HttpServer(create_app(FakeFrontend()), "127.0.0.1", 0, tls)
        await server.start()
        assert server.scheme == "https"
        async with httpx.AsyncClient(verify=client_context(pki, False)) as client:
            assert (await client.get(f"https://127.0.0.1:{server.port}/health")).status_code == 200
        await server.stop()

        mutual = ServerTLS(str(pki.server_cert), str(pki.server_key), client_ca=str(pki.ca))
        server = HttpServer(create_app(FakeFrontend()), "127.0.0.1", 0, mutual)
        await server.start()
        url = f"https://127.0.0.1:{server.port}/health"
        async with httpx.AsyncClient(verify=client_context(pki, True)) as client:
            assert (await client.get(url)).status_code == 200
        async with httpx.AsyncClient(verify=client_context(pki, False)) as client:
            with pytest.raises(httpx.TransportError):  # no client certificate: the handshake is refused
                await client.get(url)
        await server.stop()

    asyncio.run(scenario())


def test_a_taken_port_is_a_clear_start_error() -> None:
    async def scenario() -> None:
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            server = HttpServer(create_app(FakeFrontend()), "127.0.0.1", port)
            with pytest.raises(HttpStartError, match=f"cannot listen on 127.0.0.1:{port}"):
                await server.start()

    asyncio.run(scenario())


def test_a_missing_certificate_is_a_start_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        tls = ServerTLS(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"))
        with pytest.raises(HttpStartError, match="did not start"):
            await HttpServer(create_app(FakeFrontend()), "127.0.0.1", 0, tls).start()

    asyncio.run(scenario())


def test_a_call_past_the_concurrency_limit_is_refused_before_it_is_read() -> None:
    async def scenario() -> None:
        hold = asyncio.Event()
        frontend = FakeFrontend(hold=hold)
        # uvicorn counts the arriving connection itself: a limit of 2 serves one call at a time.
        server = HttpServer(create_app(frontend), "127.0.0.1", 0, limit_concurrency=2)
        await server.start()
        try:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            async with httpx.AsyncClient() as client:
                first = asyncio.create_task(client.post(url, json={"model": "smollm2", "prompt": "a"}))
                async with asyncio.timeout(30):  # until the first call is inside the frontend; the guard ends a hang
                    while not frontend.calls:
                        await asyncio.sleep(0.001)
                second = await client.post(url, json={"model": "smollm2", "prompt": "b"})
                assert second.status_code == 503 and len(frontend.calls) == 1
                hold.set()
                assert (await first).status_code == 200
        finally:
            hold.set()
            await server.stop()

    asyncio.run(scenario())
