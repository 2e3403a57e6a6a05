"""Kubernetes exec probe: ask a local server's grpc.health.v1 service over TLS.

kubelet's native gRPC probe speaks plaintext only, so once a server listens with
TLS (and mTLS on the internal tiers) the Helm chart probes it with

    python -m specserve.health_probe --port=50053 --tls-ca=... --tls-cert=... \
        --tls-key=... --server-name=<the Service's DNS name>

The probe dials 127.0.0.1, checks the server certificate against the CA under
the Service's DNS name (the name the certificate is issued for), presents the
pod's own certificate as a client certificate (which mTLS listeners require),
and exits 0 only when the server reports SERVING. Without --tls-ca it speaks
plaintext, like the native probe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specserve.health_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to dial (the pod itself)")
    parser.add_argument("--port", type=int, required=True, help="gRPC port of the server")
    parser.add_argument("--service", default="", help="health service name; empty is the whole server")
    parser.add_argument("--tls-ca", help="CA bundle that signed the server certificate (enables TLS)")
    parser.add_argument("--tls-cert", help="client certificate to present (mTLS)")
    parser.add_argument("--tls-key", help="key of --tls-cert")
    parser.add_argument("--server-name", help="name to verify the server certificate against")
    parser.add_argument("--timeout-s", type=float, default=4.0, help="deadline of the Check call")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        parser.error("--tls-cert needs --tls-ca")
    return args


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if not args.tls_ca:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes(),
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def check(args: argparse.Namespace) -> str:
    """The server's health status name, or why it could not be read."""
    try:
        with open_channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    except OSError as error:  # unreadable certificate files
        return f"cannot read TLS files: {error}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def main(argv: Sequence[str] | None = None) -> int:
    status = check(parse_args(argv))
    if status == "SERVING":
        return 0
    print(f"health check failed: {status}", file=sys.stderr)  # kubelet records it in the pod's events
    return 1


if __name__ == "__main__":
    sys.exit(main())
