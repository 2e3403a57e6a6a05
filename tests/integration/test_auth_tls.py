"""The auth matrix on one real cluster: API keys and TLS at the coordinator, internal token and mTLS behind it,
sessions bound to their tenant, and n-gram pools per tenant (in a private Redis) that PurgePool empties."""

from __future__ import annotations

import datetime
import ipaddress
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from client import GenerationParams, SpecserveClient, Stats, TextChunk, cli
from specserve.auth.keys import key_entry, new_key
from specserve.local_cluster import LocalCluster, free_port
from specserve.tenancy import TENANT_METADATA_KEY
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import wait_until
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

KEYS = {"alpha": new_key(), "beta": new_key(), "doomed": new_key()}  # doomed: alpha's key that gets revoked
TOKEN = uuid.uuid4().hex
RELOAD_S = 0.3
PROMPT = "List the planets of the solar system in order."
MAX_NEW_TOKENS = 16


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None, **kind: bool
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if kind.get("server"):
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def bytes(self, path: Path) -> bytes:
        return path.read_bytes()


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate for the coordinator."""

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return cert_path, key_path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert("specserve-test-ca", ca_key, None)
    ca, _ = write("ca", ca_cert, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = write("server", _cert("localhost", server_key, ("specserve-test-ca", ca_key), server=True), server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = write("coordinator", _cert("coordinator", client_key, ("specserve-test-ca", ca_key)), client_key)
    return Pki(ca, server[0], server[1], client[0], client[1])


def write_keys(path: Path, names: list[str]) -> None:
    tenant = {"alpha": "alpha", "doomed": "alpha", "beta": "beta"}
    lines = ["keys:"] + [f"  {key_entry(KEYS[name], tenant[name], name)}" for name in names]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class Secured:
    cluster: LocalCluster
    pki: Pki
    keys_file: Path
    token_file: Path
    redis: redis.Redis


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    directory = tmp_path_factory.mktemp("auth")
    pki = make_pki(directory)
    token_file = directory / "internal-token"
    token_file.write_text(TOKEN + "\n")
    keys_file = directory / "keys.yaml"
    write_keys(keys_file, ["alpha", "beta", "doomed"])
    serve_tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    worker = [*serve_tls, "--tls-client-ca", str(pki.ca), "--internal-token-file", str(token_file)]
    with RedisServer() as redis_server:
        cluster = LocalCluster(
            free_port(), free_port(), free_port(), redis_url=redis_server.url, log_dir=directory / "logs"
        )
        cluster.extra_verifier_args = [*worker, "--no-profile-cost"]
        # The n-gram pool alone drafts: what a tenant's request drafts comes from the pool only, and the drafter
        # starts without loading a draft head.
        cluster.extra_drafter_args = [*worker, "--sources", "ngram_pool"]
        cluster.extra_coordinator_args = [
            *serve_tls,
            "--api-keys-file",
            str(keys_file),
            "--api-keys-reload-s",
            str(RELOAD_S),
            "--internal-token-file",
            str(token_file),
            "--internal-tls-ca",
            str(pki.ca),
            "--internal-tls-cert",
            str(pki.client_cert),
            "--internal-tls-key",
            str(pki.client_key),
        ]
        cluster.coordinator_credentials = grpc.ssl_channel_credentials(pki.bytes(pki.ca))
        client = redis.Redis.from_url(redis_server.url)
        with cluster:
            yield Secured(cluster, pki, keys_file, token_file, client)
        client.close()


def generate(secured: Secured, api_key: str | None, text: str = PROMPT, max_new_tokens: int = MAX_NEW_TOKENS) -> Stats:
    tls_ca = str(secured.pki.ca)
    with SpecserveClient(secured.cluster.coordinator_address, timeout_s=120, api_key=api_key, tls_ca=tls_ca) as c:
        tokens = 0
        for event in c.generate_chat([("user", text)], GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                tokens += len(event.token_ids)
            else:
                assert event.num_generated_tokens == tokens
                return event
    raise AssertionError("the stream ended without stats")


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


# ---- the coordinator: API keys over TLS ----


def test_no_key_is_unauthenticated_and_says_how_to_send_one(secured: Secured) -> None:
    error = rpc_error(lambda: generate(secured, None))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "authorization: Bearer <key>" in error.details()  # type: ignore[attr-defined]


def test_a_wrong_key_is_unauthenticated(secured: Secured) -> None:
    error = rpc_error(lambda: generate(secured, new_key()))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "unknown or was revoked" in error.details()  # type: ignore[attr-defined]


def test_a_valid_key_streams_a_whole_generation_over_tls(secured: Secured) -> None:
    stats = generate(secured, KEYS["alpha"], "Say hello in French.", max_new_tokens=8)
    assert stats.num_generated_tokens > 0
    assert stats.finish_reason in ("length", "eos")


def test_a_plaintext_client_cannot_talk_to_the_tls_coordinator(secured: Secured) -> None:
    def plaintext() -> None:
        with SpecserveClient(secured.cluster.coordinator_address, timeout_s=10, api_key=KEYS["alpha"]) as c:
            list(c.generate("hi", GenerationParams(max_new_tokens=2)))

    assert rpc_error(plaintext).code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_a_revoked_key_stops_working_after_the_reload_interval(secured: Secured) -> None:
    assert generate(secured, KEYS["doomed"], "Say yes.", max_new_tokens=2).num_generated_tokens > 0
    write_keys(secured.keys_file, ["alpha", "beta"])
    # The coordinator rereads the file every RELOAD_S: the key works until a reload has seen the new file.

    def refused() -> grpc.RpcError | None:
        try:
            generate(secured, KEYS["doomed"], "Say yes.", max_new_tokens=2)
        except grpc.RpcError as error:
            return error
        return None

    # 60 s: only a guard against a coordinator that never reloads.
    error = wait_until(refused, 60, "the revoked key is refused", every_s=RELOAD_S)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "revoked" in error.details()  # type: ignore[attr-defined]


# ---- the verifier and the drafter accept only the coordinator ----


@contextmanager
def verifier_stub(secured: Secured, client_cert: bool = True) -> Iterator[verifier_pb2_grpc.VerifierServiceStub]:
    """The coordinator's view of the verifier: TLS, with its client certificate (mTLS) unless told otherwise."""
    pki = secured.pki
    credentials = grpc.ssl_channel_credentials(
        pki.bytes(pki.ca),
        pki.bytes(pki.client_key) if client_cert else None,
        pki.bytes(pki.client_cert) if client_cert else None,
    )
    with grpc.secure_channel(secured.cluster.verifier_address, credentials) as channel:
        yield verifier_pb2_grpc.VerifierServiceStub(channel)


def internal(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKEN}"), (TENANT_METADATA_KEY, tenant))


def test_a_session_belongs_to_the_tenant_that_created_it(secured: Secured) -> None:
    with verifier_stub(secured) as stub:
        session_calls(stub)


def session_calls(stub: verifier_pb2_grpc.VerifierServiceStub) -> None:
    session = uuid.uuid4().hex
    stub.Prefill(verifier_pb2.PrefillRequest(session_id=session, token_ids=[1, 2, 3]), metadata=internal("alpha"))
    verify = verifier_pb2.VerifyRequest(session_id=session, num_committed_tokens=3, tree=common_pb2.TokenTree())
    release = verifier_pb2.ReleaseRequest(session_id=session)
    for call in (
        lambda: stub.Verify(verify, metadata=internal("beta")),
        lambda: stub.Release(release, metadata=internal("beta")),
        lambda: stub.Prefill(verifier_pb2.PrefillRequest(session_id=session, token_ids=[7]), metadata=internal("beta")),
    ):
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert "belongs to another caller or tenant" in error.details()  # type: ignore[attr-defined]
    stub.Verify(verify, metadata=internal("alpha"))
    assert stub.Release(release, metadata=internal("alpha")).released


def test_the_verifier_wants_the_internal_token(secured: Secured) -> None:
    with verifier_stub(secured) as stub:
        error = rpc_error(
            lambda: stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), metadata=((TENANT_METADATA_KEY, "alpha"),))
        )
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert "--internal-token-file" in error.details()  # type: ignore[attr-defined]
        assert stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), metadata=internal("alpha")).vocab_size > 0


def test_the_verifier_wants_a_client_certificate(secured: Secured) -> None:
    with verifier_stub(secured, client_cert=False) as stub:
        error = rpc_error(
            lambda: stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), metadata=internal("alpha"), timeout=10)
        )
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def drafter_channel(secured: Secured) -> grpc.Channel:
    pki = secured.pki
    credentials = grpc.ssl_channel_credentials(pki.bytes(pki.ca), pki.bytes(pki.client_key), pki.bytes(pki.client_cert))
    return grpc.secure_channel(secured.cluster.drafter_address, credentials)


def test_the_drafter_wants_the_internal_token(secured: Secured) -> None:
    with drafter_channel(secured) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        error = rpc_error(lambda: stub.DrafterInfo(drafter_pb2.DrafterInfoRequest()))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "--internal-token-file" in error.details()  # type: ignore[attr-defined]


# ---- n-gram pools per tenant ----


def pool_counts(client: redis.Redis) -> dict[str, dict[str, float]]:
    """Per pool namespace (``specserve:{namespace}:{fingerprint}:ng:...``), each n-gram key's total count."""
    counts: dict[str, dict[str, float]] = {}
    for key in client.scan_iter("specserve:*"):
        prefix, ngram = key.decode().split(":ng:")
        namespace = prefix.removeprefix("specserve:").rsplit(":", 1)[0]
        counts.setdefault(namespace, {})[ngram] = sum(score for _, score in client.zrange(key, 0, -1, withscores=True))
    return counts


def test_tenants_teach_only_their_own_pools_and_purge_removes_one(
    secured: Secured, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same text from two tenants: each request writes its own namespace only, and PurgePool forgets alpha's.

    (That a namespace's lookups never see another's is unit-tested, test_auth.py: with the n-gram pool as the
    only source the drafter's tree builder finds pool drafts not worth a CPU verify until it has seen them
    accepted, so draft counts cannot show it here.)
    """
    secured.redis.flushdb()
    generate(secured, KEYS["alpha"])
    alpha = pool_counts(secured.redis)
    assert set(alpha) == {"tenant:alpha"} and alpha["tenant:alpha"]
    generate(secured, KEYS["beta"])
    both = pool_counts(secured.redis)
    assert set(both) == {"tenant:alpha", "tenant:beta"}
    assert both["tenant:alpha"] == alpha["tenant:alpha"], "beta's request left alpha's pool untouched"
    assert set(both["tenant:beta"]) == set(alpha["tenant:alpha"]), "the same text, recorded separately"
    assert set(both["tenant:beta"].values()) == {1.0}, "beta's pool holds its own single request"

    token = (("authorization", f"Bearer {TOKEN}"),)
    with drafter_channel(secured) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        purged = stub.PurgePool(drafter_pb2.PurgePoolRequest(pool_namespace="tenant:alpha"), metadata=token)
    assert purged.redis_keys == len(alpha["tenant:alpha"])
    assert purged.memory_pools == 1 and purged.memory_keys > 0
    assert pool_counts(secured.redis) == {"tenant:beta": both["tenant:beta"]}

    pki = secured.pki
    purge_beta = ["admin", "purge-pool", "--drafter", secured.cluster.drafter_address, "--tenant", "beta"]
    purge_beta += ["--internal-token-file", str(secured.token_file), "--tls-ca", str(pki.ca)]
    assert cli.main([*purge_beta, "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]) == 0
    assert f"{len(both['tenant:beta'])} Redis keys" in capsys.readouterr().out
    assert pool_counts(secured.redis) == {}
