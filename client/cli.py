"""The ``specserve`` command line: stream a generation from a coordinator; operator commands (``admin``)."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from client.sdk import GenerationParams, SpecserveClient, Stats
from specserve.tenancy import Tenant
from specserve.v1 import drafter_pb2, drafter_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="specserve client")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream a generation to stdout, then a stats line to stderr")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument(
        "--target",
        default=os.environ.get("SPECSERVE_ADDR", "localhost:50051"),
        help="coordinator address (env SPECSERVE_ADDR)",
    )
    gen.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
    gen.add_argument("--system", help="system message for the chat")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy decoding")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--speculation",
        choices=("auto", "off"),
        default="auto",
        help="off: plain decoding, no drafting (the output is the same either way)",
    )
    gen.add_argument("--max-draft-tokens", type=int, default=0, help="cap on draft tokens per round; 0: the server's")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this JSON Schema file")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output matches this Lark grammar file")
    shape.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    gen.add_argument("--timeout-s", type=float, default=300.0, help="deadline of the whole request")
    gen.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="API key, sent as `authorization: Bearer <key>` (env SPECSERVE_API_KEY)",
    )
    gen.add_argument("--tls", action="store_true", help="connect over TLS, checking the server with the system roots")
    gen.add_argument("--tls-ca", help="connect over TLS, checking the server against this PEM CA file")
    admin = commands.add_parser("admin", help="operator commands").add_subparsers(dest="admin", required=True)
    purge = admin.add_parser(
        "purge-pool", help="make drafters forget a tenant's n-gram pool (in memory and in the shared Redis)"
    )
    purge.add_argument("--drafter", action="append", required=True, help="drafter address (repeat for each replica)")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", help="the tenant whose own pool to purge")
    which.add_argument("--namespace", help="a pool namespace as is: 'shared' or 'tenant:<name>'")
    purge.add_argument(
        "--internal-token-file",
        default=os.environ.get("SPECSERVE_INTERNAL_TOKEN_FILE"),
        help="the drafters' internal token (env SPECSERVE_INTERNAL_TOKEN_FILE)",
    )
    purge.add_argument("--tls-ca", help="PEM CA of the drafters' certificates (TLS)")
    purge.add_argument("--tls-cert", help="client certificate, for drafters that require mTLS")
    purge.add_argument("--tls-key", help="key of --tls-cert")
    return parser


def purge_pool(args: argparse.Namespace) -> int:
    namespace = args.namespace or Tenant(args.tenant).pool_namespace
    metadata: tuple[tuple[str, str], ...] = ()
    if args.internal_token_file:
        with open(args.internal_token_file) as f:
            metadata = (("authorization", f"Bearer {f.read().strip()}"),)
    credentials = None
    if args.tls_ca or args.tls_cert:

        def read(path: str | None) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    for address in args.drafter:
        channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
        with channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            try:
                request = drafter_pb2.PurgePoolRequest(pool_namespace=namespace)
                r = stub.PurgePool(request, timeout=60, metadata=metadata)
            except grpc.RpcError as exc:
                print(f"specserve: drafter {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        print(
            f"{address}: purged {namespace}: {r.memory_keys} in-memory keys in {r.memory_pools} pools, "
            f"{r.successor_tables} successor tables, {r.redis_keys} Redis keys"
        )
    return 0


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path) as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "admin":
        return purge_pool(args)
    params = GenerationParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        speculation=args.speculation,
        max_draft_tokens=args.max_draft_tokens,
        json_schema=_read(args.json_schema),
        regex=args.regex,
        lark_grammar=_read(args.grammar),
        choice=args.choice,
    )
    chat = [("system", args.system)] if args.system else []
    chat.append(("user", args.prompt))
    try:
        with SpecserveClient(
            args.target, timeout_s=args.timeout_s, api_key=args.api_key, tls=args.tls, tls_ca=args.tls_ca
        ) as client:
            events = client.generate(args.prompt, params) if args.raw else client.generate_chat(chat, params)
            for event in events:
                if isinstance(event, Stats):
                    print(f"\n[{event.summary()}]", file=sys.stderr)
                else:
                    print(event.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"\nspecserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
