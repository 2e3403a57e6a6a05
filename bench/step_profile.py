"""Where a verify step's time goes on the host: ``python -m bench.step_profile``.

A captured GPU step (or a small model on a CPU) leaves the verifier's own
Python as the cost: building the step's inputs, the head, acceptance. This
times ``Verifier.verify`` for one session and for B sessions at once, at 1
and at the machine's torch thread count, then profiles the engine thread
(cProfile) and prints the functions that took the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.verifier import Verifier

from .verify_cost import SHAPES, random_model


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.step_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--num-layers", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--sessions", type=int, default=8, help="sessions verifying together in the batched case")
    parser.add_argument("--draft-nodes", type=int, default=3, help="chain length each verify sends")
    parser.add_argument("--steps", type=int, default=100)
    return parser.parse_args(argv)


def run(verifier: Verifier, sessions: int, nodes: int, steps: int, committed: dict[str, int]) -> float:
    """Milliseconds per round in which ``sessions`` sessions each verify a chain of ``nodes`` nodes."""
    names = [f"s{i}" for i in range(sessions)]

    def one(name: str) -> None:
        tree = TokenTree.chain([(7 * i + 1) % 100 for i in range(nodes)])
        committed[name] += len(verifier.verify(name, committed[name], tree).committed)

    started = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        for _ in range(steps):
            list(pool.map(one, names))
    return (time.perf_counter() - started) / steps * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = random_model(args.shape, args.num_layers, getattr(torch, args.dtype), args.device)
    verifier = Verifier(
        model, "profile", kv_cache_bytes=2**30, max_tree_nodes=64, compile=args.compile, throughput_guard=False
    )
    committed = {}
    for i in range(max(args.sessions, 1)):
        verifier.prefill(f"s{i}", list(range(3, 515)), SamplingParams())
        committed[f"s{i}"] = 512
    print(f"{args.shape} {args.dtype} on {args.device}: {verifier.step_form}", flush=True)
    threads = torch.get_num_threads()
    for count in dict.fromkeys((threads, 1)):
        torch.set_num_threads(count)
        for sessions in (1, args.sessions):
            run(verifier, sessions, args.draft_nodes, 10, committed)
            ms = run(verifier, sessions, args.draft_nodes, args.steps, committed)
            print(f"torch threads {count}, {sessions} sessions x {args.draft_nodes + 1} rows: {ms:.2f} ms a round")
    profile = cProfile.Profile()
    step = verifier._step

    def profiled() -> bool:
        profile.enable()
        try:
            return step()
        finally:
            profile.disable()

    verifier._step = profiled  # type: ignore[method-assign]
    for sessions in (1, args.sessions):
        run(verifier, sessions, args.draft_nodes, args.steps, committed)
        stats = pstats.Stats(profile).sort_stats("tottime")
        print(f"\n--- engine thread, {sessions} sessions, {args.steps} rounds: by own time")
        stats.print_stats(22)
        profile = cProfile.Profile()
    verifier.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
