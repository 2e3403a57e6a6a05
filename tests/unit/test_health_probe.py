"""specserve.health_probe: the exec probe the Helm chart uses once servers speak TLS."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specserve import health_probe

SERVICE_NAME = "specserve-verifier.specserve.svc.cluster.local"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey, ca: bool
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA and one pod certificate for the verifier Service's DNS name, as cert-manager writes them."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    pod_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("specserve-ca", ca_key, "specserve-ca", ca_key, ca=True)
    pod = _issue(SERVICE_NAME, pod_key, "specserve-ca", ca_key, ca=False)
    files = {"ca": folder / "ca.crt", "cert": folder / "tls.crt", "key": folder / "tls.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(pod.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        pod_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files


def _serve(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, servicer, port


@pytest.fixture(scope="module")
def mtls_server(tls_files: dict[str, Path]) -> Iterator[tuple[health.HealthServicer, int]]:
    credentials = grpc.ssl_server_credentials(
        [(tls_files["key"].read_bytes(), tls_files["cert"].read_bytes())],
        root_certificates=tls_files["ca"].read_bytes(),
        require_client_auth=True,
    )
    server, servicer, port = _serve(credentials)
    yield servicer, port
    server.stop(None)


def _tls_args(port: int, files: dict[str, Path], *extra: str) -> list[str]:
    return [
        f"--port={port}",
        f"--tls-ca={files['ca']}",
        f"--tls-cert={files['cert']}",
        f"--tls-key={files['key']}",
        f"--server-name={SERVICE_NAME}",
        "--timeout-s=2",
        *extra,
    ]


def test_plaintext_probe_follows_the_serving_status() -> None:
    server, servicer, port = _serve(None)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert health_probe.main([f"--port={port}"]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert health_probe.main([f"--port={port}"]) == 0
    finally:
        server.stop(None)


def test_mtls_probe_presents_the_pod_certificate(
    mtls_server: tuple[health.HealthServicer, int], tls_files: dict[str, Path]
) -> None:
    servicer, port = mtls_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert health_probe.main(_tls_args(port, tls_files)) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_probe.main(_tls_args(port, tls_files)) == 1


def test_mtls_probe_fails_without_a_client_certificate_or_with_the_wrong_name(
    mtls_server: tuple[health.HealthServicer, int], tls_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, port = mtls_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    no_client_cert = [f"--port={port}", f"--tls-ca={tls_files['ca']}", f"--server-name={SERVICE_NAME}", "--timeout-s=2"]
    assert health_probe.main(no_client_cert) == 1
    assert health_probe.main(_tls_args(port, tls_files, "--server-name=other.example.com")) == 1
    assert "health check failed: UNAVAILABLE" in capsys.readouterr().err


def test_a_closed_port_or_missing_files_fail_the_probe(tmp_path: Path) -> None:
    server, _, port = _serve(None)
    server.stop(None)
    assert health_probe.main([f"--port={port}", "--timeout-s=1"]) == 1
    missing = tmp_path / "absent.crt"
    assert health_probe.main([f"--port={port}", f"--tls-ca={missing}"]) == 1


def test_half_a_client_certificate_is_refused() -> None:
    with pytest.raises(SystemExit):
        health_probe.parse_args(["--port=1", "--tls-ca=ca.crt", "--tls-cert=tls.crt"])
