"""Authentication: the key file, its reload, the exposure rule, the interceptors, session owners, pool namespaces."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.ngram_pool import PoolShape
from draft_service.pools import PoolRegistry
from specserve.auth.interceptors import (
    KEYS_REVOKED,
    MISSING_KEY,
    ApiKeyInterceptor,
    InternalTokenInterceptor,
    bearer,
)
from specserve.auth.internal import InternalCredentials, session_owner
from specserve.auth.keys import ApiKeys, KeyFileError, digest, key_entry, new_key, parse_key_file
from specserve.auth.tls import ExposureError, check_exposure, is_loopback
from specserve.errors import PermissionDenied
from specserve.rpc import add_health, mark_serving
from specserve.sampling import SamplingParams
from specserve.tenancy import TENANT_METADATA_KEY, Tenant, current_tenant, tenant_scope
from specserve.token_tree import TokenTree
from specserve.v1 import generation_pb2, generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from target_service.verifier import Verifier
from tests.conftest import tiny_llama
from tests.redis_server import RedisServer

KEY_A, KEY_B = new_key(), new_key()


def key_file(*entries: tuple[str, str, str], tenants: str = "") -> str:
    lines = [tenants, "keys:"] if tenants else ["keys:"]
    lines += [f"  {key_entry(key, tenant, name)}" for key, tenant, name in entries]
    return "\n".join(lines) + "\n"


# ---- the key file ----


def test_keys_are_random_and_stored_as_their_sha256() -> None:
    assert KEY_A != KEY_B and len(KEY_A) > 40
    table = parse_key_file(key_file((KEY_A, "acme", "ci"), (KEY_B, "beta", "web")))
    assert set(table.principals) == {digest(KEY_A), digest(KEY_B)}
    principal = table.lookup(KEY_A)
    assert principal is not None and principal.key_name == "ci" and principal.tenant == Tenant("acme")
    assert table.lookup("ssk_guess") is None
    assert table.lookup(digest(KEY_A)) is None  # the stored digest is not itself a key


def test_tenant_settings_apply_to_their_keys() -> None:
    text = key_file(
        (KEY_A, "acme", "ci"), tenants="tenants:\n  acme: {max_concurrent_streams: 8, share_ngram_pool: true}"
    )
    principal = parse_key_file(text).lookup(KEY_A)
    assert principal is not None
    assert principal.tenant == Tenant("acme", max_concurrent_streams=8, share_ngram_pool=True)
    assert principal.tenant.pool_namespace == "shared"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("keys: [unclosed", "not valid YAML"),
        ("- just a list", "must be a mapping"),
        ("users: []", "unknown sections ['users']"),
        ("keys: {name: x}", "'keys' must be a list"),
        ("keys:\n  - {name: ci, tenant: acme}", "keys[0] lacks sha256"),
        ("keys:\n  - {sha256: " + "a" * 64 + "}", "keys[0] lacks name, tenant"),
        ("keys:\n  - {name: ci, tenant: acme, sha256: ssk_plainkey}", "sha256 must be 64 hex digits"),
        ("keys:\n  - {name: ci, tenant: 'a:b', sha256: " + "a" * 64 + "}", "tenant name 'a:b'"),
        ("tenants:\n  acme: {max_concurrent_streams: -1}", "max_concurrent_streams must be an integer >= 0"),
        ("tenants:\n  acme: {share_ngram_pool: 'yes'}", "share_ngram_pool must be true or false"),
        ("tenants:\n  acme: {rate: 3}", "unknown settings ['rate']"),
    ],
)
def test_a_bad_key_file_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(KeyFileError, match=r"keys\.yaml") as raised:
        parse_key_file(text, "keys.yaml")
    assert says in str(raised.value)


def test_duplicate_digests_are_refused() -> None:
    with pytest.raises(KeyFileError, match="the same digest as 'ci'"):
        parse_key_file(key_file((KEY_A, "acme", "ci"), (KEY_A, "beta", "again")))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_keys_reload_when_the_file_changes_and_revoked_keys_stop_working(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(key_file((KEY_A, "acme", "ci")))
    clock = Clock()
    keys = ApiKeys(path, reload_s=2.0, clock=clock)
    assert keys.lookup(KEY_A) is not None and keys.lookup(KEY_B) is None
    path.write_text(key_file((KEY_B, "beta", "web")))  # KEY_A revoked, KEY_B added
    clock.now = 1.0
    assert keys.lookup(KEY_A) is not None, "checked at most every reload_s"
    clock.now = 2.5
    assert keys.lookup(KEY_A) is None
    assert keys.lookup(KEY_B) is not None


def test_a_secret_update_swapping_a_symlink_is_seen(tmp_path: Path) -> None:
    """Kubernetes updates a mounted Secret by pointing a symlink at a new directory."""
    for name, key in (("v1", KEY_A), ("v2", KEY_B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keys.yaml").write_text(key_file((key, "acme", name)))
    (tmp_path / "..data").symlink_to("v1")
    path = tmp_path / "keys.yaml"
    path.symlink_to("..data/keys.yaml")
    clock = Clock()
    keys = ApiKeys(path, reload_s=1.0, clock=clock)
    assert keys.lookup(KEY_A) is not None
    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    clock.now = 5.0
    assert keys.lookup(KEY_B) is not None and keys.lookup(KEY_A) is None


def test_a_broken_file_keeps_the_last_good_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(key_file((KEY_A, "acme", "ci")))
    clock = Clock()
    keys = ApiKeys(path, reload_s=1.0, clock=clock)
    path.write_text("keys: [ {name: half-written")
    clock.now = 2.0
    with caplog.at_level(logging.ERROR):
        assert keys.lookup(KEY_A) is not None
    assert "keeping the last good keys" in caplog.text
    path.unlink()
    path.mkdir()  # there but unreadable (a mode of 0 would not stop root)
    clock.now = 4.0
    assert keys.lookup(KEY_A) is not None and not keys.revoked
    path.rmdir()
    path.write_text(key_file((KEY_B, "acme", "ci")))
    clock.now = 6.0
    assert keys.lookup(KEY_B) is not None and keys.lookup(KEY_A) is None


def test_a_deleted_file_revokes_every_key_until_it_is_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(key_file((KEY_A, "acme", "ci")))
    clock = Clock()
    keys = ApiKeys(path, reload_s=1.0, clock=clock)
    path.unlink()
    assert keys.lookup(KEY_A) is not None, "checked at most every reload_s"
    clock.now = 2.0
    with caplog.at_level(logging.ERROR):
        assert keys.lookup(KEY_A) is None
    assert keys.revoked
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "EVERY API KEY IS REVOKED" in caplog.text and str(path) in caplog.text
    caplog.clear()
    clock.now = 4.0
    assert keys.lookup(KEY_A) is None and caplog.records == [], "logged once per removal"
    path.write_text("keys: [ {name: half-written")  # back, but half written: still nothing is valid
    clock.now = 6.0
    assert keys.lookup(KEY_A) is None and keys.revoked
    path.write_text(key_file((KEY_A, "acme", "ci")))  # the very same content as before the removal
    clock.now = 8.0
    with caplog.at_level(logging.WARNING):
        assert keys.lookup(KEY_A) is not None
    assert not keys.revoked and "is back" in caplog.text


def test_a_deleted_secret_revokes_too(tmp_path: Path) -> None:
    """A Kubernetes Secret removed from under its mount leaves a dangling symlink: the same as a deleted file."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "keys.yaml").write_text(key_file((KEY_A, "acme", "v1")))
    (tmp_path / "..data").symlink_to("v1")
    path = tmp_path / "keys.yaml"
    path.symlink_to("..data/keys.yaml")
    clock = Clock()
    keys = ApiKeys(path, reload_s=1.0, clock=clock)
    (tmp_path / "..data").unlink()
    clock.now = 2.0
    assert keys.lookup(KEY_A) is None and keys.revoked


def test_a_broken_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read"):
        ApiKeys(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("keys: 3")
    with pytest.raises(KeyFileError, match="must be a list"):
        ApiKeys(tmp_path / "bad.yaml")


# ---- the exposure rule ----


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_exposure("coordinator", host, authenticated=False, insecure=False, how="--api-keys-file", tls=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "specserve.example.com"])
def test_a_reachable_server_without_auth_refuses_to_start_unless_insecure(
    host: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert not is_loopback(host)
    with pytest.raises(ExposureError, match="pass --api-keys-file, or --insecure"):
        check_exposure("coordinator", host, authenticated=False, insecure=False, how="--api-keys-file", tls=True)
    with caplog.at_level(logging.WARNING):
        check_exposure("coordinator", host, authenticated=False, insecure=True, how="--api-keys-file", tls=True)
    assert "WITHOUT authentication" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_exposure("coordinator", host, authenticated=True, insecure=False, how="--api-keys-file", tls=False)
    assert "TLS is off" in caplog.text


# ---- the interceptors, on in-process servers ----


class TenantEcho(generation_pb2_grpc.GenerationServiceServicer):
    """Streams the name of the tenant its handler runs for, twice (an async generator, like the real one)."""

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        for _ in range(2):
            await asyncio.sleep(0)
            yield generation_pb2.GenerateResponse(delta=generation_pb2.TextDelta(text=current_tenant().name))


def test_api_key_interceptor(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(key_file((KEY_A, "acme", "ci"), (KEY_B, "beta", "web")))
    keys = ApiKeys(path)

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)])
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(TenantEcho(), server)
        mark_serving(add_health(server, []), [])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)

                async def texts(metadata: tuple[tuple[str, str], ...]) -> list[str]:
                    call = stub.Generate(generation_pb2.GenerateRequest(prompt="x"), metadata=metadata)
                    return [r.delta.text async for r in call]

                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await texts(())
                assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert missing.value.details() == MISSING_KEY
                with pytest.raises(grpc.aio.AioRpcError) as wrong:
                    await texts((("authorization", "Bearer ssk_wrong"),))
                assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "unknown or was revoked" in (wrong.value.details() or "")
                assert await texts((("authorization", f"Bearer {KEY_A}"),)) == ["acme", "acme"]
                assert await texts((("authorization", f"bearer {KEY_B}"),)) == ["beta", "beta"]
                path.unlink()
                keys.reload()  # the trigger the next check would pull
                with pytest.raises(grpc.aio.AioRpcError) as revoked:
                    await texts((("authorization", f"Bearer {KEY_A}"),))
                assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert revoked.value.details() == KEYS_REVOKED
                health = health_pb2_grpc.HealthStub(channel)
                answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    assert current_tenant().name == "default"


class OwnerEcho(verifier_pb2_grpc.VerifierServiceServicer):
    def VerifierInfo(
        self, request: verifier_pb2.VerifierInfoRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierInfoResponse:
        return verifier_pb2.VerifierInfoResponse(model_name=session_owner(context.invocation_metadata(), None))


@pytest.fixture
def token_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[InternalTokenInterceptor("s3cret")])
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(OwnerEcho(), server)
    mark_serving(add_health(server, []), [])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_internal_token_interceptor(token_server: str) -> None:
    with grpc.insecure_channel(token_server) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        for metadata, says in [((), "send the internal token"), ((("authorization", "Bearer nope"),), "is wrong")]:
            with pytest.raises(grpc.RpcError) as raised:
                stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), metadata=metadata)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            assert says in raised.value.details()  # type: ignore[attr-defined]
        with tenant_scope(Tenant("acme")):
            metadata = InternalCredentials("s3cret").metadata()
        assert stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), metadata=metadata).model_name == "/acme"
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_bearer_parsing() -> None:
    assert bearer([("authorization", "Bearer abc")]) == "abc"
    assert bearer([("authorization", "Basic abc")]) is None
    assert bearer([("authorization", "Bearer ")]) is None
    assert bearer([(TENANT_METADATA_KEY, "acme")]) is None


# ---- sessions belong to their owner ----


def test_a_session_answers_only_its_owner() -> None:
    verifier = Verifier(tiny_llama(), "fp")
    try:
        verifier.submit_prefill("s", [1, 2, 3], SamplingParams(), owner="coord/acme").result()
        with pytest.raises(PermissionDenied):
            verifier.submit_verify("s", 3, TokenTree(), owner="coord/beta").result()
        with pytest.raises(PermissionDenied):
            verifier.submit_prefill("s", [4, 5], SamplingParams(), owner="coord/beta").result()
        with pytest.raises(PermissionDenied):
            verifier.release("s", owner="coord/beta")
        verifier.submit_verify("s", 3, TokenTree(), owner="coord/acme").result()
        assert verifier.release("s", owner="coord/acme")
    finally:
        verifier.close()


# ---- pools per tenant ----

SHAPE = PoolShape(key_len=2, continuation_len=2)


def test_pools_are_per_namespace_and_purged_alone() -> None:
    pools = PoolRegistry(SHAPE, None, 0.05, 1000)
    pools("fp", "tenant:a").record([1, 2, 3, 4, 5])
    assert pools("fp", "tenant:a").lookup([1, 2]) == [(3, 4)]
    assert pools("fp", "tenant:b").lookup([1, 2]) == []
    assert pools("other-fp", "tenant:a").lookup([1, 2]) == []
    counts = pools.purge_memory("tenant:a")
    assert (counts.memory_pools, counts.memory_keys) == (2, 2)
    assert pools("fp", "tenant:a").lookup([1, 2]) == []


def test_purge_deletes_only_the_namespaces_redis_keys() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        pools = PoolRegistry(SHAPE, server.url, 1.0, 1000)
        for namespace in ("tenant:a", "tenant:a-b", "shared", "tenant:shared"):
            pool = pools("fp", namespace)
            pool.record([1, 2, 3, 4, 5])
            pool.flush()
        assert len(client.keys("specserve:tenant:a:fp:ng:*")) == 2
        assert pools.purge_shared("tenant:a") == 2
        assert pools.purge_shared("shared") == 2
        left = sorted(key.decode().split(":ng:")[0] for key in client.keys("*"))
        assert left == ["specserve:tenant:a-b:fp"] * 2 + ["specserve:tenant:shared:fp"] * 2
        client.close()
