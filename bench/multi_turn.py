"""Agent loops turn by turn, with kept caches and without: what starting from the last turn's cache saves.

Each agent conversation of ``bench/data/agent_loop.jsonl`` is played as an agent framework plays it: the first
request is its system prompt and task, every later one is the conversation so far (the model's own answer, then
the next tool result or user message of the dataset). Two clusters of the three processes run the same
conversations, taking turns conversation by conversation: one verifier keeps released sessions' caches (its
default, ``--kept-prefixes``), the other keeps none. Greedy, so both produce the same text, which is checked.

Per turn: the prompt's tokens, those the verifier copied from a kept cache, the verifier's prefill time, the time
to the first text on the client, and the whole request's time. The report compares the two clusters on the
turns after the first (the first turn of a conversation shares only the system prompt with earlier ones).

    make bench-multi-turn                                                   # 14 conversations, up to 4 turns each
    make bench-multi-turn BENCH_MULTI_TURN_ARGS="--conversations 2 --max-new-tokens 16 --out-dir /tmp/turns"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import machine
from bench.cluster import choose_pool, start_cluster
from bench.dataset import Question, load_agent_loops
from client import GenerationParams, SpecserveClient, Stats, TextChunk

ARMS = ("kept", "none")
ARM_ARGS = {"kept": ["--kept-prefixes", "32"], "none": ["--kept-prefixes", "0"]}


@dataclass(frozen=True)
class Conversation:
    """An agent conversation as turns: the first request's messages, then the message each later turn adds."""

    question_id: int
    opening: tuple[tuple[str, str], ...]
    followups: tuple[tuple[str, str], ...]


def conversations(questions: Sequence[Question], max_turns: int) -> list[Conversation]:
    """Each conversation up to its first user message, then its later non-assistant messages (tool results,
    user turns) one a turn; the dataset's assistant messages are replaced by the model's own answers."""
    out = []
    for question in questions:
        turns = question.messages()
        first_user = next(i for i, (role, _) in enumerate(turns) if role == "user")
        later = tuple(turn for turn in turns[first_user + 1 :] if turn[0] != "assistant")
        out.append(Conversation(question.question_id, turns[: first_user + 1], later[: max_turns - 1]))
    return out


@dataclass
class Turn:
    conversation: int
    index: int  # 0: the opening request
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    first_text_s: float  # on the client, from sending the request
    total_s: float  # on the client
    generated_tokens: int
    text: str


def play(client: SpecserveClient, conversation: Conversation, max_new_tokens: int) -> list[Turn]:
    """The conversation turn by turn on one cluster; each turn's answer goes into the next turn's prompt."""
    messages = list(conversation.opening)
    played = []
    for index in range(len(conversation.followups) + 1):
        if index:
            messages.append(conversation.followups[index - 1])
        start = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        stats: Stats | None = None
        for event in client.generate_chat(messages, GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                first = time.perf_counter() - start if first is None else first
                pieces.append(event.text)
            else:
                stats = event
        total = time.perf_counter() - start
        if stats is None:
            raise RuntimeError("the coordinator ended the stream without stats")
        text = "".join(pieces)
        played.append(
            Turn(
                conversation.question_id,
                index,
                stats.num_prompt_tokens,
                stats.num_cached_prompt_tokens,
                stats.prefill_s,
                total if first is None else first,
                total,
                stats.num_generated_tokens,
                text,
            )
        )
        messages.append(("assistant", text))
    return played


@dataclass
class ArmSummary:
    arm: str
    turns: int  # the turns after the first of each conversation
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    median_first_text_s: float
    total_s: float


@dataclass
class Report:
    summaries: dict[str, ArmSummary]
    identical: int
    compared: int
    meta: dict[str, Any] = field(default_factory=dict)

    def ratio(self, name: str) -> float:
        """``name`` (an ArmSummary field) without kept caches over with them: how many times faster."""
        kept, none = getattr(self.summaries["kept"], name), getattr(self.summaries["none"], name)
        return none / kept if kept else float("nan")


def summarize(played: dict[str, list[Turn]]) -> Report:
    summaries = {}
    for arm, turns in played.items():
        later = [t for t in turns if t.index > 0]
        summaries[arm] = ArmSummary(
            arm,
            len(later),
            sum(t.prompt_tokens for t in later),
            sum(t.cached_tokens for t in later),
            sum(t.prefill_s for t in later),
            statistics.median(t.first_text_s for t in later) if later else 0.0,
            sum(t.total_s for t in later),
        )
    pairs = list(zip(played["kept"], played["none"], strict=True))
    return Report(summaries, sum(a.text == b.text for a, b in pairs), len(pairs))


def markdown(report: Report) -> str:
    host = report.meta.get("machine", {})
    lines = [
        "# Agent loops turn by turn: kept caches against none",
        "",
        f"Machine: {host.get('cpu_model', '?')} ({host.get('cpus_available', '?')} CPUs, "
        f"{', '.join(host.get('cpu_flags', []))}); settings: {report.meta.get('settings', {})}",
        "",
        "| verifier | later turns | prompt tokens | copied from a kept cache | prefill s | median time to first text s "
        "| requests' time s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report.summaries.values():
        share = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        lines.append(
            f"| {'--kept-prefixes 32' if s.arm == 'kept' else '--kept-prefixes 0'} | {s.turns} | {s.prompt_tokens} "
            f"| {s.cached_tokens} ({share:.0%}) | {s.prefill_s:.2f} | {s.median_first_text_s:.3f} | {s.total_s:.2f} |"
        )
    lines += [
        "",
        f"Without kept caches over with them: prefill {report.ratio('prefill_s'):.2f}x, time to first text "
        f"{report.ratio('median_first_text_s'):.2f}x, requests' time {report.ratio('total_s'):.2f}x. "
        f"Identical text: {report.identical}/{report.compared} turns.",
    ]
    return "\n".join(lines) + "\n"


def write_report(report: Report, played: dict[str, list[Turn]], out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "meta": report.meta,
        "summaries": {arm: asdict(s) for arm, s in report.summaries.items()},
        "identical": report.identical,
        "compared": report.compared,
        "turns": {arm: [asdict(t) for t in turns] for arm, turns in played.items()},
    }
    paths = out_dir / "multi_turn.json", out_dir / "multi_turn.md"
    paths[0].write_text(json.dumps(document, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    return paths


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.multi_turn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=14, help="agent conversations played (at most 14)")
    parser.add_argument("--max-turns", type=int, default=4, help="requests per conversation, the first included")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--torch-threads", type=int, default=0, help="the verifiers' (0: the CPUs available)")
    parser.add_argument(
        "--redis-url",
        default="",
        help="a pool both drafters share; empty (default): each its own in memory, so that neither learns the "
        "conversations from the other's turns",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/multi_turn"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.torch_threads or len(os.sched_getaffinity(0))
    plays = conversations(load_agent_loops()[: args.conversations], args.max_turns)
    pool = choose_pool(args.redis_url)
    clusters = {
        arm: start_cluster(args.model, pool, threads, args.out_dir / "logs" / arm, verifier_args=ARM_ARGS[arm])
        for arm in ARMS
    }
    played: dict[str, list[Turn]] = {arm: [] for arm in ARMS}
    try:
        clients = {arm: SpecserveClient(c.coordinator_address, timeout_s=600.0) for arm, c in clusters.items()}
        for arm in ARMS:  # warm-up: each cluster's first request carries one-off costs
            list(clients[arm].generate_chat([("user", "Say hi.")], GenerationParams(max_new_tokens=4)))
        for i, conversation in enumerate(plays):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                played[arm] += play(clients[arm], conversation, args.max_new_tokens)
                print(f"conversation {conversation.question_id} ({arm}): {len(played[arm])} turns so far", flush=True)
        for client in clients.values():
            client.close()
    finally:
        for cluster in clusters.values():
            cluster.stop()
    report = summarize(played)
    report.meta = {
        "machine": machine.describe(),
        "settings": {
            "conversations": len(plays),
            "max_turns": args.max_turns,
            "max_new_tokens": args.max_new_tokens,
            "torch_threads": threads,
            "model": args.model,
        },
    }
    json_path, md_path = write_report(report, played, args.out_dir)
    print(markdown(report))
    print(f"wrote {json_path}, {md_path}")
    return 0 if report.identical == report.compared else 1


if __name__ == "__main__":
    raise SystemExit(main())
