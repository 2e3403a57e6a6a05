"""The load benchmark: ``python -m bench.load`` (``make bench-load``).

Starts the three services, then for each concurrency level N runs N greedy
streams at once through the coordinator's public gRPC API (the async client
SDK) while polling the verifier's VerifierInfo for its KV cache. Every level takes
fresh Spec-Bench prompts that no earlier level sent, so the shared n-gram pool
has not seen them. After the levels (and with the services stopped, so it does
not compete for the CPUs) the harness decodes every prompt plainly with the
target and counts the streams that are token-identical to it. Writes
``bench_load.json`` and ``bench_load.md`` to the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from client.sdk import AsyncSpecserveClient, GenerationParams, Stats
from specserve.local_cluster import LocalCluster
from specserve.model_loading import DEFAULT_MODEL
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from target_service.verifier import Verifier

from . import machine
from .cluster import DEFAULT_REDIS_URL, ClusterStartError, PoolBackend, choose_pool, clear_pool, start_cluster
from .dataset import CATEGORIES, load_questions, select
from .head_identity import describe_draft_head, draft_head_path
from .load_report import (
    LevelResult,
    StreamResult,
    VerifierLoad,
    check_targets,
    markdown,
    summarize_all,
    table,
    target_lines,
)
from .numerics import decode_ids_alone, top2_at
from .pinning import Pinning, pin_this_process, read_pinning
from .records import first_divergence
from .target import DEVICE, WARM_UP_TEXT, WARM_UP_TOKENS, TargetText, chat_ids, load_target_text, quiet_libraries

DEFAULT_LEVELS = (1, 4, 16, 64)
POLL_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 2.0
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoadPrompt:
    question_id: int
    category: str
    text: str
    token_ids: list[int]  # as the coordinator encodes the chat turn


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"--levels must be positive integers, got {text!r}")
    return levels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.load", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="comma-separated concurrency levels"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stream-timeout-s", type=float, default=900.0, help="deadline of every stream")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/load"))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target: 'smollm2' or a model path")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads of the verifier and of the reference decoding (default: the CPUs available)",
    )
    parser.add_argument(
        "--device",
        default=DEVICE,
        help="where the verifier and the drafter run (their --device; a --verifier-arg or --drafter-arg saying "
        "otherwise wins) and the reference decoding: cpu (default) or cuda[:N]",
    )
    parser.add_argument(
        "--verifier-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="appended to the verifier's command line, split like a shell does; repeatable, "
        "e.g. --verifier-arg='--dtype bfloat16'",
    )
    parser.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="appended to the coordinator's command line, e.g. --coordinator-arg=\"--drafter ''\" "
        "(plain decoding through the batching verifier, for comparison)",
    )
    parser.add_argument(
        "--drafter-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="appended to the drafter's command line, e.g. --drafter-arg='--draft-head-path OTHER.pt' "
        "(the report names the head by its SHA-256)",
    )
    parser.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="Redis for the drafter's n-gram pool ('' for in-memory); this vocabulary's keys there are emptied "
        "after the warm-up stream (default: the benchmarks' own database, /15)",
    )
    parser.add_argument(
        "--pin-verifier-cpus",
        metavar="CPUS",
        help="separate hardware on one machine: the verifier on these CPUs (e.g. 0, with torch threads to match), "
        "the drafter, the coordinator and this client on the others; with --coordinator-arg=\"--drafter ''\" "
        "the verifier alone on the same CPUs, for capacity against the drafter tier",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip plain decoding and the identity check")
    parser.add_argument(
        "--reference-dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="dtype of the reference decoding; auto: the verifier's (its VerifierInfo, else its --dtype, else float32)",
    )
    args = parser.parse_args(argv)
    try:
        args.levels = parse_levels(args.levels)
    except ValueError as exc:
        parser.error(str(exc))
    args.verifier_args = [word for value in args.verifier_arg for word in shlex.split(value)]
    args.coordinator_args = [word for value in args.coordinator_arg for word in shlex.split(value)]
    args.drafter_args = [word for value in args.drafter_arg for word in shlex.split(value)]
    read_pinning(parser, args)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda[:N], not {args.device!r}")
    if args.max_new_tokens < 1 or args.torch_threads < 1 or args.stream_timeout_s <= 0:
        parser.error("--max-new-tokens and --torch-threads must be at least 1, --stream-timeout-s above 0")
    return args


def progress(message: str) -> None:
    print(f"[bench.load {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plan_levels(levels: Sequence[int], target: TargetText) -> list[list[LoadPrompt]]:
    """Consecutive slices of the Spec-Bench prompts in round-robin category order: level N takes the next N."""
    questions = load_questions()
    ordered = select(questions, CATEGORIES, len(questions))
    if sum(levels) > len(ordered):
        raise SystemExit(f"error: the levels need {sum(levels)} prompts; Spec-Bench has {len(ordered)}")
    plan, start = [], 0
    for n in levels:
        chunk = ordered[start : start + n]
        ids = [chat_ids(target.tokenizer, q.text) for q in chunk]
        plan.append([LoadPrompt(q.question_id, q.category, q.text, i) for q, i in zip(chunk, ids, strict=True)])
        start += n
    return plan


async def run_stream(
    client: AsyncSpecserveClient, prompt: LoadPrompt, params: GenerationParams, timeout_s: float
) -> StreamResult:
    """One stream; a failure becomes the result's error (its gRPC status code name), never an exception."""
    tokens: list[int] = []
    stats: Stats | None = None
    ttft_s: float | None = None
    error: str | None = None
    message = ""
    start = time.perf_counter()
    try:
        # The gRPC deadline ends the call; this guard only covers a client that would not notice.
        async with asyncio.timeout(timeout_s + 30):
            async for event in client.generate_chat([("user", prompt.text)], params):
                if isinstance(event, Stats):
                    stats = event
                    continue
                if ttft_s is None:
                    ttft_s = time.perf_counter() - start
                tokens.extend(event.token_ids)
    except grpc.aio.AioRpcError as exc:
        error, message = exc.code().name, exc.details() or ""
    except TimeoutError:
        error, message = "DEADLINE_EXCEEDED", f"no end of stream within {timeout_s + 30:.0f} s (client side)"
    latency_s = time.perf_counter() - start
    if error is None and stats is None:
        error, message = "NO_STATS", "the stream ended without its final stats"
    return StreamResult(
        question_id=prompt.question_id,
        category=prompt.category,
        prompt_tokens=len(prompt.token_ids),
        token_ids=tokens,
        finish_reason=stats.finish_reason if stats else None,
        latency_s=latency_s,
        ttft_s=ttft_s,
        generated_tokens=stats.num_generated_tokens if stats else 0,
        rounds=stats.num_rounds if stats else 0,
        stats_prompt_tokens=stats.num_prompt_tokens if stats else None,
        error=error,
        error_message=message,
    )


def record_info(load: VerifierLoad, info: verifier_pb2.VerifierInfoResponse) -> None:
    load.polls += 1
    load.dtype = info.dtype or load.dtype
    load.peak_kv_cache_used_bytes = max(load.peak_kv_cache_used_bytes, info.kv_cache_used_bytes)
    load.kv_cache_capacity_bytes = max(load.kv_cache_capacity_bytes, info.kv_cache_capacity_bytes)
    load.peak_active_sessions = max(load.peak_active_sessions, info.num_active_sessions)
    load.peak_queued_requests = max(load.peak_queued_requests, info.num_queued_requests)
    load.max_batch_tokens = max(load.max_batch_tokens, info.max_batch_tokens)


async def poll_verifier(stub: verifier_pb2_grpc.VerifierServiceStub, load: VerifierLoad, stop: asyncio.Event) -> None:
    """VerifierInfo every POLL_INTERVAL_S until ``stop``; a failed poll is counted, not raised."""
    while not stop.is_set():
        try:
            record_info(load, await stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), timeout=INFO_TIMEOUT_S))
        except grpc.aio.AioRpcError:
            load.failed_polls += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL_INTERVAL_S):
                await stop.wait()


async def run_level(
    address: str,
    stub: verifier_pb2_grpc.VerifierServiceStub,
    prompts: Sequence[LoadPrompt],
    params: GenerationParams,
    timeout_s: float,
) -> LevelResult:
    """All of ``prompts`` at once, each its own stream on one channel; VerifierInfo polled throughout."""
    n = len(prompts)
    load = VerifierLoad()
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_verifier(stub, load, stop))
    done = 0

    async def tracked(prompt: LoadPrompt) -> StreamResult:
        nonlocal done
        result = await run_stream(client, prompt, params, timeout_s)
        done += 1
        outcome = result.error or f"{len(result.token_ids)} tokens"
        progress(f"N={n}: {done}/{n} streams done (question {prompt.question_id}: {outcome}, {result.latency_s:.1f} s)")
        return result

    async with AsyncSpecserveClient(address, timeout_s=timeout_s) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(tracked(p) for p in prompts))
        wall_s = time.perf_counter() - start
    stop.set()
    await poller
    try:
        info = await stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), timeout=INFO_TIMEOUT_S)
        record_info(load, info)
        load.sessions_left = info.num_active_sessions
    except grpc.aio.AioRpcError:
        load.failed_polls += 1
    return LevelResult(n, wall_s, list(streams), load)


async def warm_up(address: str, params: GenerationParams, timeout_s: float) -> None:
    """One unmeasured stream: the first generation pays one-off costs (connections, lazy initialisation)."""
    prompt = LoadPrompt(-1, "warm-up", WARM_UP_TEXT, [])
    async with AsyncSpecserveClient(address, timeout_s=timeout_s) as client:
        result = await run_stream(client, prompt, params, timeout_s)
    if result.error is not None:
        raise RuntimeError(f"the warm-up stream failed: {result.error}: {result.error_message}")


async def measure(
    cluster: LocalCluster,
    plan: Sequence[Sequence[LoadPrompt]],
    args: argparse.Namespace,
    reset_pool: Callable[[], None],
    meta: dict[str, Any],
    levels: list[LevelResult],
) -> None:
    """Warm-up, then every level in turn; ``levels`` grows as they finish, so an interruption keeps them."""
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    async with grpc.aio.insecure_channel(cluster.verifier_address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        info = await stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), timeout=30)
        meta["verifier"] = verifier_meta(info)
        await warm_up(cluster.coordinator_address, GenerationParams(max_new_tokens=WARM_UP_TOKENS), 300)
        reset_pool()  # what the warm-up taught the pool is forgotten before measuring
        for prompts in plan:
            progress(f"level N={len(prompts)}: {len(prompts)} streams, questions {[p.question_id for p in prompts]}")
            level = await run_level(cluster.coordinator_address, stub, prompts, params, args.stream_timeout_s)
            levels.append(level)
            tokens = sum(len(s.token_ids) for s in level.streams)
            errors = sum(s.error is not None for s in level.streams)
            progress(
                f"level N={level.n} done in {level.wall_s:.1f} s: {tokens} tokens, "
                f"{tokens / level.wall_s:.1f} tok/s, {errors} errors"
            )


def verifier_meta(info: verifier_pb2.VerifierInfoResponse) -> dict[str, Any]:
    return {
        "model_name": info.model_name,
        "device": info.device,
        "dtype": info.dtype,
        "max_sessions": info.max_sessions,
        "max_session_tokens": info.max_session_tokens,
        "max_tree_nodes": info.max_tree_nodes,
        "max_batch_tokens": info.max_batch_tokens,
        "kv_cache_capacity_bytes": info.kv_cache_capacity_bytes,
    }


def requested_dtype(verifier_args: Sequence[str]) -> str | None:
    """The last ``--dtype`` on the verifier's command line, if any."""
    found = None
    for i, word in enumerate(verifier_args):
        if word == "--dtype" and i + 1 < len(verifier_args):
            found = verifier_args[i + 1]
        elif word.startswith("--dtype="):
            found = word.partition("=")[2]
    return found


def resolve_dtypes(reported: str, verifier_args: Sequence[str], reference: str) -> tuple[str, str]:
    """(the verifier's dtype as the report names it, the reference decoding's dtype)."""
    requested = requested_dtype(verifier_args)
    if reported:
        label = reported
    elif requested:
        label = f"{requested} (requested; the verifier's VerifierInfo does not report its dtype)"
    else:
        label = "unreported (the verifier's VerifierInfo does not report its dtype)"
    if reference == "auto":
        guess = reported or requested or "float32"
        reference = guess if guess in DTYPES else "float32"
    return label, reference


def compare_with_reference(
    stream: StreamResult, prompt: LoadPrompt, verifier: Verifier, target: TargetText, max_new_tokens: int
) -> None:
    """Set the stream's identity fields from plain greedy decoding of the same prompt ids."""
    if stream.stats_prompt_tokens != len(prompt.token_ids):
        stream.identical = False
        stream.note = (
            f"the coordinator encoded the prompt to {stream.stats_prompt_tokens} tokens, the harness to "
            f"{len(prompt.token_ids)}: not comparable"
        )
        return
    # Plain decoding through the engine alone: the service's own kernels and fp32 head. In fp32 it is
    # token-identical to transformers' decoding (tests/unit); in bf16 it is the noise floor's reference.
    reference = decode_ids_alone(verifier, prompt.token_ids, max_new_tokens, target.eos_ids)
    divergence = first_divergence(reference.tokens, reference.eos, stream.token_ids, stream.eos, target.eos_id)
    stream.identical = divergence is None
    if divergence is not None:
        stream.first_diff = divergence.position
        stream.reference_token = divergence.baseline_token
        stream.stream_token = divergence.mode_token
        context = [*prompt.token_ids, *reference.tokens[: divergence.position]]
        stream.logit_gap = top2_at(verifier, context)[0]


def add_references(
    levels: Sequence[LevelResult],
    plan: Sequence[Sequence[LoadPrompt]],
    target: TargetText,
    dtype: str,
    max_new_tokens: int,
    device: str = DEVICE,
) -> None:
    """Plain greedy decoding of every completed stream's prompt through the engine in this process, on ``device``."""
    verifier = Verifier(target.load_model(dtype, device), "reference", throughput_guard=False)
    total = sum(s.error is None for level in levels for s in level.streams)
    done = 0
    try:
        for level, prompts in zip(levels, plan, strict=False):
            for stream, prompt in zip(level.streams, prompts, strict=True):
                if stream.error is not None:
                    continue
                compare_with_reference(stream, prompt, verifier, target, max_new_tokens)
                done += 1
                verdict = "identical" if stream.identical else f"differs at {stream.first_diff}"
                progress(f"reference {done}/{total} (N={level.n}, question {prompt.question_id}): {verdict}")
    finally:
        verifier.close()


def write_outputs(out_dir: Path, meta: dict[str, Any], levels: Sequence[LevelResult]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize_all(levels)
    targets = check_targets(summaries)
    document = {
        "meta": meta,
        "summaries": [asdict(s) for s in summaries],
        "targets": [asdict(t) for t in targets],
        "levels": [
            {
                "n": level.n,
                "wall_s": level.wall_s,
                "question_ids": [s.question_id for s in level.streams],
                "verifier": asdict(level.verifier),
                "streams": [asdict(s) for s in level.streams],
            }
            for level in levels
        ],
    }
    paths = {kind: out_dir / f"bench_load.{kind}" for kind in ("json", "md")}
    paths["json"].write_text(json.dumps(document, indent=1) + "\n")
    paths["md"].write_text(markdown(meta, summaries, levels))
    print("\n".join([*table(summaries), "", *target_lines(targets)]))
    return paths


def initial_meta(args: argparse.Namespace, target: TargetText, pool: PoolBackend) -> dict[str, Any]:
    return {
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "model": target.name,
            "model_source": machine.portable_path(target.source.name),
            "levels": args.levels,
            "prompts": sum(args.levels),
            "max_new_tokens": args.max_new_tokens,
            "temperature": 0.0,
            "stream_timeout_s": args.stream_timeout_s,
            "torch_threads": args.torch_threads,
            "device": args.device,
            "verifier_command_args": ["--torch-threads", str(args.torch_threads), *service_args(args)[0]],
            "coordinator_command_args": args.coordinator_args,
            "drafter_command_args": service_args(args)[1],
            "draft_head": describe_draft_head(draft_head_path(args.drafter_args)),
            "pool": pool.description,
            "pool_emptied_before_measuring": pool.redis_url is not None,
            "reference": "skipped (--no-reference)",
            "eos_token_ids": sorted(target.eos_ids),
            "pinning": None if args.pinning is None else args.pinning.describe(),
        },
        "machine": machine.describe(),
        "verifier": {},
        "dtype": "",
    }


def service_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The words appended to the verifier's and the drafter's command lines: both on ``--device``, then
    ``--verifier-arg``'s and ``--drafter-arg``'s words (they win)."""
    device = ["--device", args.device]
    return [*device, *args.verifier_args], [*device, *args.drafter_args]


def run_levels(
    args: argparse.Namespace,
    target: TargetText,
    plan: Sequence[Sequence[LoadPrompt]],
    pool: PoolBackend,
    meta: dict[str, Any],
    levels: list[LevelResult],
) -> str:
    """Start the cluster, measure, stop it; returns the error that stopped the run early ('' when none)."""
    log_dir = args.out_dir / "tmp" / "cluster-logs"
    pinning: Pinning | None = args.pinning
    cpus: dict[str, frozenset[int]] = {}
    verifier_args, drafter_args = service_args(args)
    if pinning is not None:
        cpus = pinning.services()
        drafter_args = [*pinning.drafter_args(), *drafter_args]
        pin_this_process(pinning.others)  # the client too
    cluster = start_cluster(
        target.name,
        pool,
        args.torch_threads,
        log_dir,
        verifier_args=verifier_args,
        coordinator_args=args.coordinator_args,
        drafter_args=drafter_args,
        cpus=cpus,
    )
    redis_url = pool.redis_url

    def reset_pool() -> None:  # the drafter's embedded in-memory pool cannot be emptied from here
        if redis_url is not None:
            clear_pool(redis_url, target.fingerprint)

    try:
        asyncio.run(measure(cluster, plan, args, reset_pool, meta, levels))
    except KeyboardInterrupt:
        return "interrupted"
    except Exception as exc:  # keep what was measured; the error goes into the report
        traceback.print_exc()
        return f"{type(exc).__name__}: {exc} (logs in {log_dir})"
    finally:
        cluster.stop()
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(args.torch_threads)
    started = time.monotonic()
    target = load_target_text(args.model)
    plan = plan_levels(args.levels, target)
    pool = choose_pool(args.redis_url)
    meta = initial_meta(args, target, pool)
    levels: list[LevelResult] = []
    progress(f"starting the cluster (pool: {pool.description}; verifier args {args.verifier_args})")
    try:
        error = run_levels(args, target, plan, pool, meta, levels)
    except ClusterStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    polled = [level.verifier.dtype for level in levels if level.verifier.dtype]
    reported = str(meta["verifier"].get("dtype", "")) or next(iter(polled), "")
    meta["dtype"], reference_dtype = resolve_dtypes(reported, args.verifier_args, args.reference_dtype)
    if not args.no_reference and levels and error != "interrupted":
        meta["settings"]["reference"] = (
            f"plain greedy decoding through the engine alone in this process, {reference_dtype} on {args.device}"
        )
        progress(f"plain greedy references in {reference_dtype}")
        try:
            add_references(levels, plan, target, reference_dtype, args.max_new_tokens, args.device)
        except KeyboardInterrupt:  # the streams not compared yet keep identical=None
            error = "interrupted while decoding the references"
    meta["complete"] = not error and len(levels) == len(plan)
    meta["error"] = error
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["machine"]["load_average_at_end"] = machine.load_average()
    meta["machine"]["cpu_steal"] = machine.steal_since(meta["machine"].get("cpu_times_at_start"))
    paths = write_outputs(args.out_dir, meta, levels)
    progress(f"wrote {', '.join(str(p) for p in paths.values())} in {meta['duration_s']:.0f} s")
    if error:
        progress(f"stopped early ({error}); the outputs hold the {len(levels)} levels measured")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
