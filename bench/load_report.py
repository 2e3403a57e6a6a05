"""What the load benchmark measures per level, its summaries, the issue's targets and the Markdown report."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .head_identity import head_line
from .machine import strain

MIB = 2**20
NA = "n/a"  # a figure this level does not have


@dataclass
class StreamResult:
    """One greedy stream of one level, as the client saw it."""

    question_id: int
    category: str
    prompt_tokens: int  # the harness's encoding of the prompt (the coordinator's chat template)
    token_ids: list[int]  # streamed output tokens, EOS excluded
    finish_reason: str | None  # from the final Stats; None when the stream failed before it
    latency_s: float  # request sent to the stream's end
    ttft_s: float | None  # request sent to the first streamed chunk
    generated_tokens: int  # Stats.num_generated_tokens (0 without Stats)
    rounds: int  # Stats.num_rounds: target forwards that committed tokens
    stats_prompt_tokens: int | None  # Stats.num_prompt_tokens: the coordinator's encoding
    error: str | None  # gRPC status code name, or a harness label (NO_STATS); None when it completed
    error_message: str = ""
    identical: bool | None = None  # token-identical to plain greedy decoding; None: not compared
    first_diff: int | None = None  # first output position that differs from the reference
    reference_token: int | None = None  # the reference's token there (None: it ended before)
    stream_token: int | None = None  # this stream's token there (None: it ended before)
    logit_gap: float | None = None  # the target's top-1 minus top-2 logit there, on the reference prefix
    note: str = ""

    @property
    def eos(self) -> bool:
        return self.finish_reason == "eos"

    @property
    def committed(self) -> int:
        """Tokens the target committed: the output plus the EOS token when it ended there."""
        return len(self.token_ids) + int(self.eos)


@dataclass
class VerifierLoad:
    """The verifier's VerifierInfo, polled during a level: peaks, and what is left once every stream closed."""

    polls: int = 0
    failed_polls: int = 0
    dtype: str = ""
    peak_kv_cache_used_bytes: int = 0
    kv_cache_capacity_bytes: int = 0
    peak_active_sessions: int = 0
    peak_queued_requests: int = 0
    max_batch_tokens: int = 0
    sessions_left: int | None = None  # num_active_sessions after the level's last stream closed


@dataclass
class LevelResult:
    n: int
    wall_s: float  # first request sent to the last stream's end
    streams: list[StreamResult]
    verifier: VerifierLoad = field(default_factory=VerifierLoad)


@dataclass(frozen=True)
class LevelSummary:
    n: int
    streams: int
    completed: int
    tokens: int  # every streamed output token, failed streams' partial outputs included
    wall_s: float
    aggregate_tokens_per_s: float
    x_of_n1: float | None  # aggregate tokens/s over that of N=1 (None without an N=1 level)
    latency_p50_s: float | None  # over completed streams
    latency_p95_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    tau: float | None  # committed tokens / rounds over completed streams
    errors: dict[str, int]  # by gRPC status code name
    identical: int | None  # None: no reference was computed
    compared: int
    peak_kv_cache_used_mib: float
    kv_cache_capacity_mib: float
    sessions_left: int | None
    peak_queued_requests: int


@dataclass(frozen=True)
class Target:
    description: str
    reached: bool | None  # None: the levels it needs were not measured
    detail: str


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(level: LevelResult, n1_tokens_per_s: float | None) -> LevelSummary:
    done = [s for s in level.streams if s.error is None]
    tokens = sum(len(s.token_ids) for s in level.streams)
    rate = tokens / level.wall_s if level.wall_s > 0 else 0.0
    rounds = sum(s.rounds for s in done)
    compared = [s for s in done if s.identical is not None]
    return LevelSummary(
        n=level.n,
        streams=len(level.streams),
        completed=len(done),
        tokens=tokens,
        wall_s=level.wall_s,
        aggregate_tokens_per_s=rate,
        x_of_n1=rate / n1_tokens_per_s if n1_tokens_per_s else None,
        latency_p50_s=percentile([s.latency_s for s in done], 50),
        latency_p95_s=percentile([s.latency_s for s in done], 95),
        ttft_p50_s=percentile([s.ttft_s for s in done if s.ttft_s is not None], 50),
        ttft_p95_s=percentile([s.ttft_s for s in done if s.ttft_s is not None], 95),
        tau=sum(s.committed for s in done) / rounds if rounds else None,
        errors=dict(sorted(Counter(s.error for s in level.streams if s.error is not None).items())),
        identical=sum(bool(s.identical) for s in compared) if compared else None,
        compared=len(compared),
        peak_kv_cache_used_mib=level.verifier.peak_kv_cache_used_bytes / MIB,
        kv_cache_capacity_mib=level.verifier.kv_cache_capacity_bytes / MIB,
        sessions_left=level.verifier.sessions_left,
        peak_queued_requests=level.verifier.peak_queued_requests,
    )


def summarize_all(levels: Sequence[LevelResult]) -> list[LevelSummary]:
    """Per-level summaries; x of N=1 is relative to the N=1 level's aggregate throughput."""
    n1 = next((level for level in levels if level.n == 1), None)
    n1_rate = summarize(n1, None).aggregate_tokens_per_s if n1 is not None else None
    return [summarize(level, n1_rate) for level in levels]


def check_targets(summaries: Sequence[LevelSummary]) -> list[Target]:
    """The issue's targets: throughput scaling and latency at N=16, and N=64 without errors."""
    by_n = {s.n: s for s in summaries}
    return [_throughput_target(by_n), _latency_target(by_n), _n64_target(by_n)]


def _throughput_target(by_n: dict[int, LevelSummary]) -> Target:
    description = "aggregate throughput at N=16 >= 5x N=1"
    one, sixteen = by_n.get(1), by_n.get(16)
    if one is None or sixteen is None or not one.aggregate_tokens_per_s:
        return Target(description, None, "not measured (needs levels 1 and 16)")
    ratio = sixteen.aggregate_tokens_per_s / one.aggregate_tokens_per_s
    detail = (
        f"{sixteen.aggregate_tokens_per_s:.1f} tok/s at N=16 vs {one.aggregate_tokens_per_s:.1f} tok/s at N=1: "
        f"{ratio:.2f}x (target 5x, {5 * one.aggregate_tokens_per_s:.1f} tok/s)"
    )
    return Target(description, ratio >= 5.0, detail)


def _latency_target(by_n: dict[int, LevelSummary]) -> Target:
    description = "p50 latency at N=16 <= 3x N=1"
    one, sixteen = by_n.get(1), by_n.get(16)
    if one is None or sixteen is None or one.latency_p50_s is None or sixteen.latency_p50_s is None:
        return Target(description, None, "not measured (needs completed streams at levels 1 and 16)")
    ratio = sixteen.latency_p50_s / one.latency_p50_s
    detail = (
        f"{sixteen.latency_p50_s:.2f} s at N=16 vs {one.latency_p50_s:.2f} s at N=1: {ratio:.2f}x "
        f"(target at most 3x, {3 * one.latency_p50_s:.2f} s)"
    )
    return Target(description, ratio <= 3.0, detail)


def _n64_target(by_n: dict[int, LevelSummary]) -> Target:
    description = "N=64 completes with no errors"
    level = by_n.get(64)
    if level is None:
        return Target(description, None, "not measured (needs level 64)")
    errors = sum(level.errors.values())
    detail = f"{level.completed}/{level.streams} streams completed, {errors} errors"
    if level.errors:
        detail += f" ({_errors_text(level.errors)})"
    return Target(description, errors == 0 and level.completed == level.streams, detail)


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in errors.items()) or "0"


def _num(value: float | None, digits: int = 2) -> str:
    return NA if value is None else f"{value:.{digits}f}"


def table(summaries: Sequence[LevelSummary]) -> list[str]:
    lines = [
        "| N | streams | tokens | aggregate tok/s | x of N=1 | p50 latency s | p95 latency s | p50 TTFT s "
        "| p95 TTFT s | tau | errors by status | identical | peak KV cache MiB / capacity | sessions left |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for s in summaries:
        identical = NA if s.identical is None else f"{s.identical}/{s.compared}"
        kv = f"{s.peak_kv_cache_used_mib:.1f} / {s.kv_cache_capacity_mib:.1f}"
        sessions = NA if s.sessions_left is None else str(s.sessions_left)
        lines.append(
            f"| {s.n} | {s.completed}/{s.streams} | {s.tokens} | {s.aggregate_tokens_per_s:.1f} | "
            f"{_num(s.x_of_n1)} | {_num(s.latency_p50_s)} | {_num(s.latency_p95_s)} | {_num(s.ttft_p50_s)} | "
            f"{_num(s.ttft_p95_s)} | {_num(s.tau)} | {_errors_text(s.errors)} | {identical} | {kv} | {sessions} |"
        )
    return lines


def target_lines(targets: Sequence[Target]) -> list[str]:
    marks = {True: "reached", False: "NOT reached", None: "not measured"}
    return [f"- **{marks[t.reached]}**: {t.description}: {t.detail}" for t in targets]


def divergence_lines(levels: Sequence[LevelResult]) -> list[str]:
    """Every stream that differs from plain decoding, with the first differing position and the top-2 gap."""
    lines = []
    for level in levels:
        for s in level.streams:
            if s.identical is False:
                where = NA if s.first_diff is None else str(s.first_diff)
                lines.append(
                    f"| {level.n} | {s.question_id} ({s.category}) | {where} | {s.reference_token} | "
                    f"{s.stream_token} | {_num(s.logit_gap, 4)} | {s.note} |"
                )
    if not lines:
        return []
    header = [
        "## Streams that differ from plain greedy decoding",
        "",
        "| N | question | first differing position | reference token | stream token | top-2 logit gap | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    return [*header, *lines, ""]


def error_lines(levels: Sequence[LevelResult]) -> list[str]:
    """The first message of each error kind per level: enough to tell a timeout from a crash."""
    lines = []
    for level in levels:
        seen: set[str] = set()
        for s in level.streams:
            if s.error is not None and s.error not in seen:
                seen.add(s.error)
                lines.append(f"- N={level.n}, {s.error}: {s.error_message or '(no message)'}")
    return ["## Errors (first message of each kind per level)", "", *lines, ""] if lines else []


def header_lines(meta: dict[str, Any]) -> list[str]:
    settings, machine = meta["settings"], meta["machine"]
    dirty = " (with uncommitted changes)" if machine.get("git_dirty") else ""
    verifier = meta.get("verifier", {})
    lines = [
        "# specserve under concurrent load",
        "",
        f"Run {meta['started_at']}, {meta.get('duration_s', 0):.0f} s; commit `{machine['git_commit']}`{dirty}"
        + ("" if meta.get("complete", True) else f"; **stopped early: {meta.get('error')}**"),
        "",
        f"- Machine: {machine['cpu_model']}, {machine['cpus_available']} CPUs available "
        f"({machine['logical_cpus']} logical; native bf16: {', '.join(machine.get('cpu_bf16_flags') or []) or 'no'}), "
        f"{machine['memory_gib']} GiB, GPU: {machine.get('cuda') or 'none'}; "
        f"torch {machine['torch_version']}, transformers {machine['transformers_version']}; "
        f"load average at start {machine.get('load_average_at_start')}, at end {machine.get('load_average_at_end')}"
        f"{strain(machine)}",
        f"- Target: {settings['model']} ({settings['model_source']}) on the verifier's {verifier.get('device') or '?'}"
        f", dtype **{meta['dtype']}**; reference decoding: {settings['reference']}",
        f"- Levels {settings['levels']}: N concurrent greedy streams (temperature 0) through the coordinator's "
        f"gRPC API, {settings['max_new_tokens']} new tokens each, stream timeout {settings['stream_timeout_s']:.0f} s",
        f"- Prompts: Spec-Bench, round-robin over categories; each level takes the next N prompts, none seen by an "
        f"earlier level ({settings['prompts']} in all)",
        f"- n-gram pool: {settings['pool']}"
        + (", emptied after the warm-up stream" if settings["pool_emptied_before_measuring"] else ""),
        f"- Verifier: `{' '.join(settings['verifier_command_args'])}`; max batch tokens "
        f"{verifier.get('max_batch_tokens') or 'unreported'}",
        f"- Coordinator: `{' '.join(settings.get('coordinator_command_args') or []) or 'defaults'}`",
        f"- Drafter: `{' '.join(settings.get('drafter_command_args') or []) or 'defaults'}`. "
        + (head_line(settings.get("draft_head")) or "Draft head: not recorded."),
        *([f"- Pinned: {settings['pinning']}"] if settings.get("pinning") else []),
        "",
    ]
    return lines


def markdown(meta: dict[str, Any], summaries: Sequence[LevelSummary], levels: Sequence[LevelResult]) -> str:
    lines = [
        *header_lines(meta),
        *table(summaries),
        "",
        "## Targets",
        "",
        *target_lines(check_targets(summaries)),
        "",
        *divergence_lines(levels),
        *error_lines(levels),
        "## Definitions",
        "",
        "- **aggregate tok/s**: output tokens streamed by all streams of the level (EOS excluded) / the level's "
        "wall time, from the first request to the last stream's end.",
        "- **latency**: one stream, request to end of stream; **TTFT**: request to the first streamed chunk. "
        "Both over the streams that completed.",
        "- **tau**: tokens committed per target forward (the EOS token counts), from the streams' final stats.",
        "- **identical**: output token-identical to plain greedy decoding of the same token ids through the "
        "verifier engine alone (one session, one token per forward, in the harness after the load levels); "
        "where not, the first differing position and the engine's fp32 top-2 logit gap there are listed. In "
        "bf16 a batched forward rounds differently from a lone one, so near-tie divergences are expected "
        "(make bench-numerics measures that noise floor); in fp32 every stream must be identical.",
        "- **peak KV cache**: the highest `kv_cache_used_bytes` the verifier's VerifierInfo reported, polled every "
        "0.5 s; **sessions left**: its `num_active_sessions` after every stream of the level closed. 0 / 0 MiB means "
        "the verifier does not report its cache; a level shorter than one poll can miss its peak.",
        "",
    ]
    return "\n".join(lines)
