"""The ``specserve`` command line: stream a generation from a coordinator."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from client.sdk import GenerationParams, SpecserveClient, Stats


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
    gen.add_argument("--timeout-s", type=float, default=300.0, help="deadline of the whole request")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    params = GenerationParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    chat = [("system", args.system)] if args.system else []
    chat.append(("user", args.prompt))
    try:
        with SpecserveClient(args.target, timeout_s=args.timeout_s) as client:
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
