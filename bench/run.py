"""The Spec-Bench benchmark: ``python -m bench.run`` (``make bench``).

``--categories code_edit,agent_loop`` (``make bench-repetitive``) runs the project's repetitive workloads instead
(``bench.dataset``), or beside Spec-Bench's categories; each gets rows of its own in the report.

Runs the chosen modes on the same prompts, interleaved prompt by prompt (the
order of the modes rotates from one prompt to the next), so machine drift hits
every mode alike. The target runs in one dtype (``--dtype``, by default what
the hardware runs fast), every mode alike but ``baseline-fp32``. Writes
``spec_bench.json`` (every record, the summaries and the machine),
``spec_bench.md`` and ``spec_bench.png`` to the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from coordinator.config import CoordinatorConfig
from draft_service.config import DrafterConfig
from draft_service.head_products import HEAD_MATMUL_CHOICES
from draft_service.head_proposer import HeadProposer
from draft_service.main import parse_config as parse_drafter_config
from specserve.block_weights import choose_model_dtype
from specserve.hardware import DtypeChoice
from specserve.model_loading import DEFAULT_MODEL, resolve_model
from specserve.sampling import SamplingParams
from target_service.engine_threads import serve_on_this_thread
from target_service.model_runner import COMPILE_CHOICES, WEIGHTS_CHOICES

from . import machine, round_breakdown
from .aggregate import summarize_all
from .cluster import (
    DEFAULT_REDIS_URL,
    ClusterStartError,
    PoolBackend,
    choose_pool,
    other_database,
    pool_reset,
    start_cluster,
)
from .dataset import (
    ALL_TASKS,
    CATEGORIES,
    WORKLOADS,
    Question,
    expand_categories,
    load_all_questions,
    select,
    workload_of,
)
from .decoding import hf_generate, top2_gap
from .head_identity import describe_draft_head
from .modes import (
    BASELINE,
    EAGER_BASELINE,
    FP32_BASELINE,
    HF_PLAIN,
    MODES,
    NO_PREDRAFT,
    OFF_IN_TURN,
    PLAIN_MODES,
    PREDRAFT,
    SPECULATION_OFF,
    UNARY_VERIFY,
    DistributedMode,
    EnginePlainMode,
    HfPlainMode,
    HfPromptLookupMode,
    InProcessMode,
    Mode,
    Outcome,
    Prompt,
    cluster_modes,
    default_modes,
    mode_sources,
    on_a_thread_of_its_own,
)
from .pinning import PinnedMode, Pinning, pin_this_process, read_pinning
from .records import Record, first_divergence, make_record
from .report import console_summary, markdown, plot
from .target import (
    DEVICE,
    WARM_UP_TEXT,
    WARM_UP_TOKENS,
    Target,
    chat_ids,
    draft_head,
    load_target,
    model_dtype,
    quiet_libraries,
    turns_ids,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# `make bench` finishes within 45 minutes on the 2-core reference machine (bench/README.md, "Spec-Bench").
DEFAULT_PROMPTS_PER_CATEGORY = 7


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.run", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--modes",
        help=f"comma-separated, from {', '.join(MODES)} (default: baseline, {EAGER_BASELINE}, {FP32_BASELINE} "
        "unless the dtype is float32, hf-pld, inproc, distributed); baseline is plain decoding through the engine",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="what every mode's target runs in (baseline-fp32: float32); auto: as the verifier's --dtype (float32 "
        "for the packaged GGUF model on any CPU)",
    )
    parser.add_argument(
        "--device",
        default=DEVICE,
        help="where the target runs in every mode: cpu (default) or cuda[:N] (greedy only); the distributed modes' "
        "drafter runs there too (its --device), the in-process modes' draft head on the CPU",
    )
    parser.add_argument("--prompts-per-category", type=int, default=DEFAULT_PROMPTS_PER_CATEGORY)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; above 0: seeded sampling (specserve still matches baseline)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed offset (seed = this + question id)")
    parser.add_argument(
        "--categories",
        default="all",
        help=f"comma-separated categories, 'mt_bench', or the repetitive workloads {', '.join(WORKLOADS)} (their "
        "own prompts: a function to edit, an agent's conversation); 'all' (default): Spec-Bench, "
        f"{', '.join(CATEGORIES)}",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out"))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target: 'smollm2' or a model path")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads here and in the distributed verifier (default: the CPUs available)",
    )
    parser.add_argument(
        "--pin-verifier-cpus",
        metavar="CPUS",
        help="separate hardware on one machine: the verifier (and baseline, inproc) on these CPUs, e.g. 0; the "
        "drafter and coordinator on the others (torch threads follow the CPU counts)",
    )
    parser.add_argument(
        "--no-throughput-guard",
        dest="throughput_guard",
        action="store_false",
        help="verifiers (inproc, distributed) size trees by their cost model alone, never switching drafting off "
        "on measured throughput: compares the drafting itself",
    )
    parser.add_argument(
        "--no-gate-drafting",
        dest="gate_drafting",
        action="store_false",
        help="coordinators (inproc, distributed) leave drafting to the verifier's budget alone, never running a "
        "session plain because its drafted rounds do not pay end to end (the coordinator's --no-gate-drafting)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="dtype",
        help="the verifier's --weights in baseline, inproc and distributed (int8: int8 copies of the layers' "
        "weights); baseline-eager and the transformers modes keep the float weights",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="the verifier's --compile in baseline, inproc and distributed (inductor: the whole step compiled, "
        "CPU); baseline-eager runs --compile off whatever this says",
    )
    parser.add_argument(
        "--dedicated-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the verifier's --dedicated-cores in distributed, and the same thread layout here: in-process "
        "verifiers compute on their engine threads, this process's own torch work (transformers' modes, the "
        "checks) on one thread",
    )
    parser.add_argument(
        "--head-matmul",
        choices=HEAD_MATMUL_CHOICES,
        default=DrafterConfig().head_logits_matmul,
        help="the draft head's products in inproc and distributed (the drafter's --head-matmul)",
    )
    parser.add_argument(
        "--flat-verify-cost",
        action="store_true",
        help="in-process verifiers and drafters size trees as if extra draft nodes cost nothing to verify (a GPU's "
        "nearly flat curve for a small model): the acceptance larger trees reach, at this CPU's throughput cost",
    )
    parser.add_argument("--hf-pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf-pld")
    parser.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="Redis for the distributed drafter's n-gram pool ('' for in-memory); its keys for this "
        "vocabulary are emptied before measuring (default: a database of its own, /15)",
    )
    parser.add_argument(
        "--keep-pool", action="store_true", help="do not empty the Redis n-gram pool first (a warm pool)"
    )
    parser.add_argument(
        "--drafter-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="appended to the distributed drafter's command line, split like a shell does; repeatable, e.g. "
        "--drafter-arg='--tree-depth 3'; the in-process modes take the same settings, except their sources "
        "(name those in the mode: inproc:a+b)",
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        default=0,
        metavar="N",
        help="before measuring, run N other prompts per category through the modes that learn (their n-gram "
        "pools then hold that traffic); these prompts are not measured",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a TTY)"
    )
    args = parser.parse_args(argv)
    args.drafter_args = [word for value in args.drafter_arg for word in shlex.split(value)]
    # The distributed drafter's own parsing (its sources, its head): a bad --drafter-arg stops the run here.
    args.drafter_config = parse_drafter_config(list(args.drafter_args))[0]
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda[:N], not {args.device!r}")
    if args.device != "cpu" and args.temperature > 0:
        parser.error("--device cuda runs greedy decoding only (the harness's keyed sampling draws on the CPU)")
    if args.device != "cpu" and args.weights != "dtype":
        parser.error("--weights int8 runs on the CPU's packed kernels: use it with --device cpu")
    if args.compile == "inductor" and (args.device != "cpu" or args.weights != "dtype"):
        parser.error(
            "--compile inductor compiles the CPU's step over the model's own weights: --device cpu, no --weights"
        )
    args.dtype_choice = choose_model_dtype(args.dtype, args.device, resolve_model(args.model))
    modes = args.modes if args.modes is not None else ",".join(default_modes(args.dtype_choice.dtype))
    args.modes = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES and mode_sources(m) is None]
    if unknown or not args.modes:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)} (or inproc:<source>+<source>...)")
    categories = CATEGORIES if args.categories == "all" else args.categories.split(",")
    try:
        args.categories = expand_categories((c.strip() for c in categories if c.strip()), ALL_TASKS)
    except ValueError as exc:
        parser.error(str(exc))
    if args.prompts_per_category < 1 or args.max_new_tokens < 1 or args.torch_threads < 1:
        parser.error("--prompts-per-category, --max-new-tokens and --torch-threads must be at least 1")
    if args.warm_pool < 0:
        parser.error("--warm-pool must be at least 0")
    clusters = cluster_modes(args.modes)
    if args.flat_verify_cost and clusters:
        parser.error(f"--flat-verify-cost sets the in-process verifiers' curve only; drop {', '.join(clusters)}")
    read_pinning(parser, args)
    return args


def make_prompt(target: Target, text: str, max_new_tokens: int, sampling: SamplingParams) -> Prompt:
    return Prompt(text, chat_ids(target.tokenizer, text), max_new_tokens, sampling)


def question_prompt(target: Target, question: Question, max_new_tokens: int, sampling: SamplingParams) -> Prompt:
    """A question as every mode runs it: its whole conversation (an agent loop's turns) chat-formatted."""
    if not question.turns:
        return make_prompt(target, question.text, max_new_tokens, sampling)
    ids = turns_ids(target.tokenizer, question.turns)
    return Prompt(question.text, ids, max_new_tokens, sampling, question.turns)


def check_baseline(model: Any, target: Target, prompt: Prompt, threads: int = 0) -> dict[str, Any]:
    """Does plain decoding through the engine (``baseline``) produce exactly what transformers' greedy generate does?
    (Both on ``threads`` torch threads, off this thread: ``on_a_thread_of_its_own``.)

    Checked on the fp32 ``model``, where they must agree token for token: in bf16 the engine's fp32 head
    (the verifier's numerics) and transformers' bf16 head part at near-ties.
    """
    greedy = replace(prompt, sampling=SamplingParams())
    engine = EnginePlainMode(model, target.fingerprint, target.eos_ids, BASELINE, "auto", threads=threads)
    try:
        ours = engine.run(greedy)
    finally:
        engine.close()
    theirs = on_a_thread_of_its_own(
        threads, lambda: hf_generate(model, greedy.token_ids, greedy.max_new_tokens, target.eos_ids)
    )
    mismatch = first_divergence(ours.tokens, ours.eos, theirs.tokens, theirs.eos, target.eos_id)
    return {
        "baseline_matches_hf_generate": mismatch is None,
        "dtype": model_dtype(model),
        "tokens_compared": len(ours.tokens) + int(ours.eos),
        "first_mismatch": None if mismatch is None else asdict(mismatch),
    }


def service_args(args: argparse.Namespace, name: str, dtype: str) -> tuple[list[str], list[str]]:
    """The words distributed mode ``name`` appends to its verifier's and its drafter's command lines.

    The verifier runs the target in ``dtype`` on ``--device`` with the run's engine flags; the drafter runs on the
    same device (its ``--device``: the draft head, its state and tree expansion; the n-gram sources stay on the
    host), with the mode's pre-drafting, the pinning's threads, then ``--drafter-arg``'s words (they win).
    """
    verifier = ["--dtype", dtype, "--weights", args.weights, "--device", args.device, "--compile", args.compile]
    verifier += ["--dedicated-cores" if args.dedicated_cores else "--no-dedicated-cores"]
    verifier += [] if args.throughput_guard else ["--no-throughput-guard"]
    drafter = ["--device", args.device, "--head-matmul", args.head_matmul]
    if name in (NO_PREDRAFT, PREDRAFT):
        outcomes = 0 if name == NO_PREDRAFT else DrafterConfig().predraft_outcomes
        drafter += ["--predraft-outcomes", str(outcomes)]
    if args.pinning is not None:
        drafter += args.pinning.drafter_args()
    return verifier, [*drafter, *args.drafter_args]


def build_modes(args: argparse.Namespace, target: Target, fp32: Any, pool: PoolBackend, stack: ExitStack) -> list[Mode]:
    """The modes named by ``--modes`` (``fp32``: the target in float32); the stack stops the cluster and closes
    the modes."""
    modes: list[Mode] = []
    clusters: dict[str, tuple[str, Callable[[], None] | None]] = {}  # mode name -> (address, pool reset)
    for name in args.modes:
        mode: Mode
        if name in (BASELINE, EAGER_BASELINE, FP32_BASELINE):
            model = fp32 if name == FP32_BASELINE else target.model
            compile = "off" if name == EAGER_BASELINE else args.compile if name == BASELINE else "auto"
            weights = args.weights if name == BASELINE else "dtype"
            mode = EnginePlainMode(
                model, target.fingerprint, target.eos_ids, name, compile, weights, args.engine_threads
            )
        elif name == HF_PLAIN:
            mode = HfPlainMode(target.model, target.eos_ids, threads=args.engine_threads)
        elif name == "hf-pld":
            mode = HfPromptLookupMode(target.model, target.eos_ids, args.hf_pld_tokens, args.engine_threads)
        elif name == "inproc" or name.startswith("inproc:"):
            sources = mode_sources(name) or DrafterConfig().sources
            # On the run's device, as the distributed mode's drafter (--device) runs it.
            head = draft_head(target, fp32, args.head_matmul, args.device) if HeadProposer.name in sources else None
            mode = InProcessMode(
                target.model,
                target.tokenizer,
                target.fingerprint,
                target.eos_ids,
                sources,
                head,
                args.throughput_guard,
                args.flat_verify_cost,
                args.weights,
                args.compile,
                args.engine_threads,
                args.gate_drafting,
                args.drafter_config,  # --drafter-arg: the same drafter settings as the distributed modes'
                target.source.name,  # the cost curve the distributed verifier keeps (or measures) on this machine
            )
        elif name == SPECULATION_OFF or (name == "distributed" and name in clusters):
            # The distributed cluster, shared: speculation on and off differ only in the requests.
            if "distributed" not in clusters:
                clusters["distributed"] = start_mode_cluster(args, target, "distributed", pool, stack)
            address, reset = clusters["distributed"]
            off = name == SPECULATION_OFF
            mode = DistributedMode(address, target.dtype, None if off else reset, name, "off" if off else "auto")
        else:
            clusters[name] = start_mode_cluster(args, target, name, pool, stack)
            address, reset = clusters[name]
            if name == OFF_IN_TURN:  # plain decoding: no pool to reset
                mode = DistributedMode(address, target.dtype, None, name, "off")
            else:
                mode = DistributedMode(address, target.dtype, reset, name=name)
        if args.pinning is not None:  # in-process modes on the verifier's CPUs, the client on the others
            in_process = not isinstance(mode, DistributedMode)
            mode = PinnedMode(mode, args.pinning.verifier if in_process else args.pinning.others)
        stack.callback(mode.close)
        modes.append(mode)
    return modes


def start_mode_cluster(
    args: argparse.Namespace, target: Target, name: str, pool: PoolBackend, stack: ExitStack
) -> tuple[str, Callable[[], None] | None]:
    """Start distributed mode ``name``'s three processes; their coordinator's address and pool reset."""
    log_dir = args.out_dir / "tmp" / "cluster-logs" / name
    verifier_args, drafter_args = service_args(args, name, target.dtype)
    pinning: Pinning | None = args.pinning
    # Each distributed mode learns into a pool of its own: one must not draft from the other's outputs.
    own_pool = pool if name == "distributed" else other_database(pool, name)
    cluster = start_cluster(
        target.name,
        own_pool,
        args.torch_threads,
        log_dir,
        verifier_args=verifier_args,
        coordinator_args=[
            *([] if args.gate_drafting else ["--no-gate-drafting"]),
            *(["--verify-transport", "unary"] if name == UNARY_VERIFY else []),
            *(["--no-verify-ahead"] if name == OFF_IN_TURN else []),
        ],
        drafter_args=drafter_args,
        cpus=pinning.services() if pinning is not None else {},
    )
    stack.callback(cluster.stop)
    return cluster.coordinator_address, pool_reset(own_pool, target.fingerprint, args.keep_pool)


def uses_head(modes: Sequence[str], drafter_sources: Sequence[str] = DrafterConfig().sources) -> bool:
    """Whether any of ``modes`` drafts with the draft head (a cluster's drafter runs ``drafter_sources``)."""
    for name in modes:
        if name == "inproc" or name.startswith("inproc:"):
            if HeadProposer.name in (mode_sources(name) or DrafterConfig().sources):
                return True
        elif name not in (*PLAIN_MODES, "hf-pld") and HeadProposer.name in drafter_sources:
            return True
    return False


def fill_pools(
    target: Target,
    questions: Sequence[Question],
    max_new_tokens: int,
    sampling: Callable[[int], SamplingParams],
    modes: Sequence[Mode],
    disable_progress: bool | None,
) -> None:
    """The warm-pool pass: unmeasured prompts through every mode that learns from traffic."""
    learners = [mode for mode in modes if mode.learns]
    with tqdm(total=len(questions) * len(learners), unit="gen", desc="warm pool", disable=disable_progress) as bar:
        for question in questions:
            prompt = question_prompt(target, question, max_new_tokens, sampling(question.question_id))
            for mode in learners:
                mode.run(prompt)
                bar.update()


def run_prompt(
    index: int, question: Question, prompt: Prompt, modes: Sequence[Mode], target: Target, progress: tqdm
) -> list[Record]:
    """Run every mode on one prompt (in an order rotated by ``index``); records in ``modes`` order.

    Each mode's output is compared with ``baseline``'s when both run in the same dtype (a mode in another
    dtype, ``baseline-fp32`` in a bf16 run, is compared with nothing). The top-2 gap at a divergence is
    computed on the baseline's prefix by the baseline's model, with fp32 logits.
    """
    k = index % len(modes)
    outcomes: dict[str, Outcome] = {}
    for mode in [*modes[k:], *modes[:k]]:
        progress.set_postfix_str(f"{question.category} #{question.question_id} {mode.name}")
        outcomes[mode.name] = mode.run(prompt)
        progress.update()
    baseline = outcomes.get(BASELINE)
    gaps: dict[int, float] = {}

    def gap_at(position: int) -> float | None:
        if baseline is None or not prompt.sampling.greedy:
            return None
        if position not in gaps:
            gaps[position] = top2_gap(target.model, prompt.token_ids, baseline.tokens[:position], target.fp32_head)
        return gaps[position]

    return [
        make_record(
            mode.name,
            question.category,
            question.question_id,
            len(prompt.token_ids),
            outcomes[mode.name],
            baseline if mode.dtype == target.dtype else None,
            target.eos_id,
            gap_at,
        )
        for mode in modes
    ]


def write_outputs(out_dir: Path, records: list[Record], modes: Sequence[str], meta: dict[str, Any]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize_all(records, modes)
    paths = {kind: out_dir / f"spec_bench.{kind}" for kind in ("json", "md", "png")}
    document = {
        "meta": meta,
        "summaries": [asdict(s) for s in summaries],
        "records": [asdict(r) for r in records],
    }
    paths["json"].write_text(json.dumps(document, indent=1) + "\n")
    paths["md"].write_text(markdown(summaries, records, modes, meta))
    if records:
        plot(summaries, modes, paths["png"])
    else:
        paths["png"].unlink(missing_ok=True)
    print("\n".join(console_summary(summaries, modes)))
    if breakdown := round_breakdown.table(records, modes):
        print("\nWhere a round's time goes (mean ms per round)", *breakdown, sep="\n")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    threads, cpus = torch.get_num_threads(), frozenset(os.sched_getaffinity(0))
    try:
        return _run(parse_args(argv))
    finally:
        # A caller in this process (the smoke tests) keeps its own thread count, and its CPUs: a pinned run
        # (--pin-verifier-cpus) left every later test of the process, and the services it starts, on one CPU.
        torch.set_num_threads(threads)
        pin_this_process(cpus)


def _run(args: argparse.Namespace) -> int:
    quiet_libraries()
    if args.pinning is not None:
        pin_this_process(args.pinning.verifier)
    torch.set_num_threads(args.torch_threads)
    # --dedicated-cores: as the verifier runs with it, the engine threads compute and this one (transformers'
    # modes and checks included) runs torch on one thread (target_service.engine_threads).
    args.engine_threads = serve_on_this_thread() if args.dedicated_cores else args.torch_threads
    started = time.monotonic()
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    all_questions = load_all_questions()
    questions = select(all_questions, args.categories, args.prompts_per_category)
    warm_questions = select(all_questions, args.categories, args.warm_pool, skip=args.prompts_per_category)
    choice: DtypeChoice = args.dtype_choice
    target = load_target(args.model, choice.dtype, args.device)
    fp32 = target.fp32_model()

    def sampling(question_id: int) -> SamplingParams:
        if args.temperature <= 0:
            return SamplingParams()
        return SamplingParams(temperature=args.temperature, seed=args.seed + question_id)

    prompts = [question_prompt(target, q, args.max_new_tokens, sampling(q.question_id)) for q in questions]
    checks = check_baseline(fp32, target, prompts[0], args.engine_threads)
    if not checks["baseline_matches_hf_generate"]:
        print(f"warning: the baseline loop differs from transformers' generate: {checks}", file=sys.stderr)
    pool = choose_pool(args.redis_url) if cluster_modes(args.modes) else PoolBackend(None, "not used")
    policy = CoordinatorConfig()
    drafter: DrafterConfig = args.drafter_config
    meta: dict[str, Any] = {
        "started_at": started_at,
        "settings": {
            "model": target.name,
            "model_source": machine.portable_path(target.source.name),
            "dtype": target.dtype,
            "dtype_requested": args.dtype,
            "dtype_reason": choice.reason,
            "device": args.device,
            "modes": args.modes,
            "categories": args.categories,
            "workloads": list(dict.fromkeys(workload_of(c) for c in args.categories)),
            "prompts_per_category": args.prompts_per_category,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "hf_pld_num_tokens": args.hf_pld_tokens,
            "max_draft_tokens": policy.max_draft_tokens,
            "draft_timeout_ms": policy.draft_timeout_ms,
            "distributed_pool": pool.description,
            "pool_emptied_before_measuring": pool.redis_url is not None and not args.keep_pool,
            "warm_pool_prompts_per_category": args.warm_pool,
            "warm_pool_prompts": len(warm_questions),
            "warm_pool_question_ids": [q.question_id for q in warm_questions],
            "eos_token_ids": sorted(target.eos_ids),
            "pinning": None if args.pinning is None else args.pinning.describe(),
            "throughput_guard": args.throughput_guard,
            "flat_verify_cost": args.flat_verify_cost,
            "gate_drafting": args.gate_drafting,
            "weights": args.weights,
            "compile": args.compile,
            "dedicated_cores": args.dedicated_cores,
            "head_matmul": args.head_matmul,
            "drafter_args": args.drafter_args,
            "draft_head": describe_draft_head(Path(drafter.draft_head_path))
            if uses_head(args.modes, drafter.sources)
            else None,
        },
        "machine": machine.describe(),
        "checks": checks,
    }
    if args.pinning is not None:  # the harness sees only the verifier's CPUs now: count the machine's
        meta["machine"]["cpus_available"] = len(args.pinning.verifier | args.pinning.others)
    records: list[Record] = []
    error = ""
    with ExitStack() as stack:
        try:
            modes = build_modes(args, target, fp32, pool, stack)
        except ClusterStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        meta["settings"]["mode_dtypes"] = {mode.name: mode.dtype for mode in modes}
        products = [m.head_products for m in modes if isinstance(m, InProcessMode) and m.head_products]
        if products and meta["settings"].get("draft_head"):
            meta["settings"]["draft_head"]["products"] = products[0]  # in-process; a drafter times its own
        # What cut the in-process drafters' trees: each mode's verifier measured its own curve at start-up.
        meta["settings"]["verify_costs"] = {
            mode.name: [list(point) for point in mode.verify_cost] for mode in modes if isinstance(mode, InProcessMode)
        }
        # The first generation of each mode pays one-off costs (lazy initialisation, connections);
        # what the warm-up taught the n-gram pools is forgotten before measuring.
        warm_up = make_prompt(target, WARM_UP_TEXT, WARM_UP_TOKENS, sampling(0))
        for mode in modes:
            mode.run(warm_up)
            mode.reset()
        disable = None if args.progress is None else not args.progress
        if warm_questions:
            fill_pools(target, warm_questions, args.max_new_tokens, sampling, modes, disable)
        progress = stack.enter_context(tqdm(total=len(prompts) * len(modes), unit="gen", disable=disable))
        try:
            for index, (question, prompt) in enumerate(zip(questions, prompts, strict=True)):
                records += run_prompt(index, question, prompt, modes, target, progress)
        except KeyboardInterrupt:
            error = "interrupted"
        except Exception as exc:  # keep what was measured; the error goes into the report
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
    meta["complete"] = not error
    meta["error"] = error
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["machine"]["load_average_at_end"] = machine.load_average()
    meta["machine"]["cpu_steal"] = machine.steal_since(meta["machine"].get("cpu_times_at_start"))
    paths = write_outputs(args.out_dir, records, args.modes, meta)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {meta['duration_s']:.0f} s", file=sys.stderr)
    if error:
        print(f"stopped early ({error}); the outputs hold the {len(records)} records measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
