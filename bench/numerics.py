"""The bf16 noise floor and where speculative output diverges: ``python -m bench.numerics`` (``make bench-numerics``).

In bf16 a forward's results depend on how many rows share it, so plain greedy
decoding disagrees with itself across forward shapes. This harness measures
that noise floor through the verifier engine and sets speculative decoding
against it (design.md, "Numerics"). Greedy, on Spec-Bench prompts:

- A  reference: plain decoding, each session alone, one token per forward;
- B  plain decoding, batched: every prompt's session advances in one forward per step;
- C  plain decoding with 2-row forwards: each step verifies a one-node chain that is
     (almost always) rejected, so only the bonus token commits;
- D  speculative decoding in process (``bench.modes.InProcessMode``, all its draft sources);
- E  D in fp32 against an fp32 reference A, which must be token-identical.

For each variant it counts prompts whose tokens differ from A and, at each
first divergence, scores the reference's prefix with ``Verifier.score`` (fp32
logits from a fresh session) for the top-1 minus top-2 gap there: a divergence
at a near-tie is float noise, one at a wide gap would be a lost token.
Writes ``numerics_<dtype>.md`` and ``.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from draft_service.config import DrafterConfig
from draft_service.draft_head import DraftHead, DraftHeadError
from draft_service.drafter import ALL_SOURCES
from draft_service.head_proposer import HeadProposer
from specserve.model_loading import DEFAULT_MODEL
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.config import VerifierConfig
from target_service.model_runner import WEIGHTS_CHOICES
from target_service.verifier import Verifier

from . import machine
from .dataset import CATEGORIES
from .modes import InProcessMode, Prompt
from .records import first_divergence
from .target import Case, Target, TargetText, load_head, load_target_text, make_cases, progress, quiet_libraries

T = TypeVar("T")

DTYPES = ("bfloat16", "float16", "float32")
GREEDY = SamplingParams()

VARIANTS: dict[str, str] = {
    "A": "reference: plain decoding, each session alone, one token per forward",
    "B": "plain decoding, batched: all sessions advance together, one forward per step",
    "C": "plain decoding with 2-row forwards: each step verifies a one-node chain of a wrong token",
    "D": "speculative decoding in process (the inproc mode's drafter and round loop)",
    "A-fp32": "E's reference: A in fp32",
    "E": "D in fp32, compared with the fp32 reference A-fp32 (must be token-identical)",
}


@dataclass(frozen=True)
class Drafts:
    """What D and E draft with over a target: the inproc mode's sources and the draft_model source's head."""

    sources: tuple[str, ...]
    head: DraftHead | None  # needed only when that source is used


@dataclass
class Output:
    tokens: list[int]  # EOS excluded
    eos: bool


@dataclass(frozen=True)
class DivergenceAt:
    """A prompt's first divergence from the reference, with the target's margin on the reference prefix."""

    prompt: int
    category: str
    question_id: int
    position: int
    reference_token: int | None  # None: the reference ended before this position
    variant_token: int | None
    top2_gap: float  # fp32 logits: top-1 minus top-2, on the reference's context up to the divergence
    reference_is_top1: bool | None  # whether scoring the prefix again picks the reference's token


@dataclass
class VariantResult:
    name: str
    description: str
    dtype: str
    reference: str  # the variant it is compared with ("" for a reference itself)
    prompts: int
    identical: int
    diverging: int
    seconds: float
    divergences: list[DivergenceAt]
    tokens: int  # output tokens over all prompts
    forwards: int | None  # engine steps (A, B, C) or speculative rounds (D, E)
    outputs: list[list[int]] = field(default_factory=list)


# ---- plain decoding through the engine ----


@dataclass
class _Stream:
    """One session being decoded: what it committed so far, cut at EOS and the token limit."""

    session_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int]
    committed: list[int] = field(default_factory=list)  # prompt + everything the verifier committed
    tokens: list[int] = field(default_factory=list)
    eos: bool = False

    def __post_init__(self) -> None:
        self.committed = list(self.prompt)

    @property
    def done(self) -> bool:
        return self.eos or len(self.tokens) >= self.max_new_tokens

    def take(self, new: Sequence[int]) -> None:
        self.committed.extend(new)
        for token in new:
            if self.done:
                return
            if token in self.eos_ids:
                self.eos = True
                return
            self.tokens.append(token)

    def output(self) -> Output:
        return Output(self.tokens, self.eos)


def _together(verifier: Verifier, submits: Iterable[Callable[[], Future[T]]]) -> list[T]:
    """Submit every call while the engine is held, so they share one step (up to its batch budgets)."""
    with verifier.paused():
        futures = [submit() for submit in submits]
    return [future.result() for future in futures]


def _plain_tree(stream: _Stream, vocab_size: int, two_rows: bool) -> TokenTree:
    """No draft (one row), or a one-node chain of a token the target almost surely rejects (two rows).

    Should ``(pending + 1) % vocab`` be the argmax after all, it is accepted
    and greedy output is unchanged: acceptance is lossless either way.
    """
    if not two_rows:
        return TokenTree()
    return TokenTree.chain([(stream.committed[-1] + 1) % vocab_size])


def decode_alone(
    verifier: Verifier, case: Case, max_new_tokens: int, eos_ids: frozenset[int], two_rows: bool
) -> Output:
    """Plain greedy decoding of one session with nothing else in the engine (variants A and C)."""
    return decode_ids_alone(verifier, case.token_ids, max_new_tokens, eos_ids, two_rows)


def decode_ids_alone(
    verifier: Verifier, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: frozenset[int], two_rows: bool = False
) -> Output:
    """Plain greedy decoding of ``prompt_ids`` through the engine alone: one session, one verify at a time."""
    stream = _Stream(f"plain-{uuid.uuid4().hex}", list(prompt_ids), max_new_tokens, eos_ids)
    verifier.prefill(stream.session_id, stream.prompt, GREEDY)
    try:
        while not stream.done:
            tree = _plain_tree(stream, verifier.vocab_size, two_rows)
            stream.take(verifier.verify(stream.session_id, len(stream.committed), tree).committed)
    finally:
        verifier.release(stream.session_id)
    return stream.output()


def decode_batched(
    verifier: Verifier, cases: Sequence[Case], max_new_tokens: int, eos_ids: frozenset[int]
) -> list[Output]:
    """Plain greedy decoding of every case at once: each step one forward over all unfinished sessions (B)."""
    streams = [_Stream(f"batched-{uuid.uuid4().hex}", c.token_ids, max_new_tokens, eos_ids) for c in cases]
    _together(verifier, [_prefill_call(verifier, s) for s in streams])
    try:
        while active := [s for s in streams if not s.done]:
            results = _together(verifier, [_verify_call(verifier, s) for s in active])
            for stream, result in zip(active, results, strict=True):
                stream.take(result.committed)
    finally:
        for stream in streams:
            verifier.release(stream.session_id)
    return [s.output() for s in streams]


def _prefill_call(verifier: Verifier, stream: _Stream) -> Callable[[], Future[Any]]:
    return lambda: verifier.submit_prefill(stream.session_id, stream.prompt, GREEDY)


def _verify_call(verifier: Verifier, stream: _Stream) -> Callable[[], Future[Any]]:
    return lambda: verifier.submit_verify(stream.session_id, len(stream.committed), TokenTree())


# ---- comparing with the reference ----


def top2_at(verifier: Verifier, context: list[int]) -> tuple[float, int]:
    """The fp32 top-1 minus top-2 logit after ``context``, and the top-1 token: row 0 of a fresh session's score."""
    session_id = f"score-{uuid.uuid4().hex}"
    verifier.prefill(session_id, context, GREEDY)
    try:
        logits = verifier.score(session_id, TokenTree())[0].float()
    finally:
        verifier.release(session_id)
    top = torch.topk(logits, 2).values
    # argmax, not topk's index: on an exact tie it takes the lowest id, as the verifier's acceptance does.
    return float(top[0] - top[1]), int(logits.argmax())


def compare(
    verifier: Verifier, target: Target, cases: Sequence[Case], reference: Sequence[Output], other: Sequence[Output]
) -> list[DivergenceAt]:
    """The first divergence of every prompt whose output differs from the reference (an EOS ending counts)."""
    found = []
    for case, ref, out in zip(cases, reference, other, strict=True):
        divergence = first_divergence(ref.tokens, ref.eos, out.tokens, out.eos, target.eos_id)
        if divergence is None:
            continue
        gap, top1 = top2_at(verifier, case.token_ids + ref.tokens[: divergence.position])
        expected = divergence.baseline_token
        is_top1 = (
            None if expected is None else top1 == expected or (expected in target.eos_ids and top1 in target.eos_ids)
        )
        found.append(
            DivergenceAt(
                case.index,
                case.category,
                case.question_id,
                divergence.position,
                expected,
                divergence.mode_token,
                round(gap, 6),
                is_top1,
            )
        )
    return found


# ---- running the variants ----


def engine_for(target: Target, weights: str = "dtype") -> Verifier:
    """An engine with the services' default limits (the inproc mode's, so prefills chunk alike) on ``weights`` (the
    verifier's --weights); no profiling."""
    return Verifier.from_config(target.model, target.fingerprint, VerifierConfig(weights=weights), profile=False)


def _timed_engine_variant(
    name: str, verifier: Verifier, cases: Sequence[Case], run: Callable[[], list[Output]]
) -> tuple[list[Output], float, int]:
    steps = verifier.stats().num_steps
    start = time.perf_counter()
    outputs = run()
    seconds = time.perf_counter() - start
    forwards = verifier.stats().num_steps - steps
    progress(f"[{name}] {len(cases)} prompts, {sum(len(o.tokens) for o in outputs)} tokens in {seconds:.1f} s")
    return outputs, seconds, forwards


def run_alone(
    name: str, verifier: Verifier, cases: Sequence[Case], max_new_tokens: int, eos_ids: frozenset[int], two_rows: bool
) -> tuple[list[Output], float, int]:
    def run() -> list[Output]:
        outputs = []
        for i, case in enumerate(cases):
            outputs.append(decode_alone(verifier, case, max_new_tokens, eos_ids, two_rows))
            progress(f"[{name}] prompt {i + 1}/{len(cases)} ({case.category} #{case.question_id})")
        return outputs

    return _timed_engine_variant(name, verifier, cases, run)


def run_speculative(
    name: str, target: Target, drafts: Drafts, cases: Sequence[Case], max_new_tokens: int
) -> tuple[list[Output], float, int]:
    """The inproc mode on every case (its n-gram pool learns from one prompt to the next, as in ``bench.run``)."""
    mode = InProcessMode(
        target.model, target.tokenizer, target.fingerprint, target.eos_ids, drafts.sources, drafts.head
    )
    outputs, rounds = [], 0
    start = time.perf_counter()
    try:
        for i, case in enumerate(cases):
            outcome = mode.run(Prompt(case.text, case.token_ids, max_new_tokens, GREEDY))
            if outcome.note:
                progress(f"[{name}] note: {outcome.note}")
            outputs.append(Output(outcome.tokens, outcome.eos))
            rounds += outcome.rounds
            progress(
                f"[{name}] prompt {i + 1}/{len(cases)} ({case.category} #{case.question_id}): {outcome.rounds} rounds"
            )
    finally:
        mode.close()
    seconds = time.perf_counter() - start
    progress(f"[{name}] {len(cases)} prompts, {sum(len(o.tokens) for o in outputs)} tokens in {seconds:.1f} s")
    return outputs, seconds, rounds


def _result(
    name: str,
    target: Target,
    verifier: Verifier,
    cases: Sequence[Case],
    run: tuple[list[Output], float, int],
    reference: tuple[str, list[Output]] | None,
) -> VariantResult:
    """The variant's row; ``reference`` (name, outputs) is what it is compared with, None for a reference."""
    outputs, seconds, forwards = run
    divergences = [] if reference is None else compare(verifier, target, cases, reference[1], outputs)
    for d in divergences:
        progress(f"[{name}] prompt {d.prompt} diverges at {d.position}: top-2 gap {d.top2_gap:.4g}")
    return VariantResult(
        name=name,
        description=VARIANTS[name],
        dtype=target.dtype,
        reference="" if reference is None else reference[0],
        prompts=len(cases),
        identical=len(cases) - len(divergences),
        diverging=len(divergences),
        seconds=round(seconds, 2),
        divergences=divergences,
        tokens=sum(len(o.tokens) for o in outputs),
        forwards=forwards,
        outputs=[o.tokens + ([target.eos_id] if o.eos else []) for o in outputs],
    )


def run_variants(
    target: Target, drafts: Drafts, cases: Sequence[Case], max_new_tokens: int, weights: str = "dtype"
) -> list[VariantResult]:
    """A, B, C and D in the target's dtype, on ``weights``."""
    verifier = engine_for(target, weights)
    eos = target.eos_ids
    try:
        a = run_alone("A", verifier, cases, max_new_tokens, eos, two_rows=False)
        reference = ("A", a[0])
        results = [_result("A", target, verifier, cases, a, None)]
        b = _timed_engine_variant("B", verifier, cases, lambda: decode_batched(verifier, cases, max_new_tokens, eos))
        results.append(_result("B", target, verifier, cases, b, reference))
        c = run_alone("C", verifier, cases, max_new_tokens, eos, two_rows=True)
        results.append(_result("C", target, verifier, cases, c, reference))
        d = run_speculative("D", target, drafts, cases, max_new_tokens)
        results.append(_result("D", target, verifier, cases, d, reference))
    finally:
        verifier.close()
    return results


def run_fp32(target: Target, drafts: Drafts, cases: Sequence[Case], max_new_tokens: int) -> list[VariantResult]:
    """A-fp32 and E: the reference and the speculative path D on an fp32 target."""
    verifier = engine_for(target)
    try:
        a = run_alone("A-fp32", verifier, cases, max_new_tokens, target.eos_ids, two_rows=False)
        e = run_speculative("E", target, drafts, cases, max_new_tokens)
        return [
            _result("A-fp32", target, verifier, cases, a, None),
            _result("E", target, verifier, cases, e, ("A-fp32", a[0])),
        ]
    finally:
        verifier.close()


# ---- the report ----


def verdict(results: Sequence[VariantResult]) -> dict[str, Any]:
    """What the numbers say, computed from them: D against the noise floor, gaps, and fp32 identity."""
    by = {r.name: r for r in results}
    floor = max((by[n].diverging for n in ("B", "C") if n in by), default=0)
    d = by.get("D")
    d_gaps = [x.top2_gap for x in d.divergences] if d else []
    floor_gaps = [x.top2_gap for n in ("B", "C") if n in by for x in by[n].divergences]
    e = by.get("E")
    lines = []
    if d is not None:
        lines.append(f"speculative divergences D = {d.diverging} vs noise floor max(B, C) = {floor}")
        relation = "no more often than" if d.diverging <= floor else "MORE often than"
        lines.append(f"D diverges {relation} the noise floor")
    lines.append(
        f"largest top-2 gap at a divergence: {_fmt_gap(max(d_gaps, default=None))} (D), "
        f"{_fmt_gap(max(floor_gaps, default=None))} (B, C)"
    )
    if e is not None:
        lines.append(f"fp32: E token-identical to fp32 A on {e.identical}/{e.prompts} prompts")
    return {
        "d_diverging": d.diverging if d else None,
        "noise_floor": floor,
        "d_within_floor": d.diverging <= floor if d else None,
        "largest_gap_d": max(d_gaps, default=None),
        "largest_gap_floor": max(floor_gaps, default=None),
        "fp32_identical": None if e is None else e.identical,
        "fp32_prompts": None if e is None else e.prompts,
        "lines": lines,
    }


def _fmt_gap(gap: float | None) -> str:
    return "none" if gap is None else f"{gap:.4g}"


def markdown(meta: dict[str, Any], results: Sequence[VariantResult], summary: dict[str, Any]) -> str:
    settings, host = meta["settings"], meta["machine"]
    out = [
        f"# Numerics: {settings['dtype']} noise floor and speculative divergences",
        "",
        f"{meta['started_at']}, {meta['duration_s']:.0f} s. Model `{settings['model']}`, dtype `{settings['dtype']}`, "
        f"{settings['prompts']} Spec-Bench prompts (round-robin over categories), greedy, "
        f"{settings['max_new_tokens']} new tokens, draft sources {', '.join(settings['sources'])}.",
        "",
        f"Machine: {host['cpu_model']}, {host['cpus_available']} CPUs available, bf16 flags "
        f"{host['cpu_bf16_flags'] or 'none'}, torch {host['torch_version']} ({host['torch_threads']} threads), "
        f"transformers {host['transformers_version']}, commit {host['git_commit']}"
        f"{' (dirty)' if host['git_dirty'] else ''}, load average {host['load_average_at_start']}.",
        "",
        "| variant | dtype | what | compared with | prompts | identical | diverging | tokens | forwards | seconds |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        same, differ = (str(r.identical), str(r.diverging)) if r.reference else ("", "")
        forwards = "" if r.forwards is None else str(r.forwards)
        out.append(
            f"| {r.name} | {r.dtype} | {r.description} | {r.reference or '(reference)'} | {r.prompts} | {same} | "
            f"{differ} | {r.tokens} | {forwards} | {r.seconds:.1f} |"
        )
    out += [
        "",
        "Forwards: engine steps (prefill chunks included) for A, B, C, A-fp32; speculative rounds for D, E.",
        "",
    ]
    for r in results:
        if not r.divergences:
            continue
        out += [
            f"## {r.name}: first divergences from {r.reference}",
            "",
            "| prompt | category | question | position | A token | variant token | top-2 gap | A token top-1 again |",
            "|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for d in r.divergences:
            out.append(
                f"| {d.prompt} | {d.category} | {d.question_id} | {d.position} | {_tok(d.reference_token)} | "
                f"{_tok(d.variant_token)} | {d.top2_gap:.4g} | {_yes_no(d.reference_is_top1)} |"
            )
        out.append("")
    out += ["## Verdict", "", *(f"- {line}" for line in summary["lines"]), ""]
    out += [
        "Top-2 gap: the target's fp32 top-1 minus top-2 logit on A's context up to the divergence, scored by a fresh "
        'session (one prefill, then `Verifier.score` with an empty tree). "A token top-1 again" says whether that '
        "forward picks A's token: at a near-tie it may not, which is the noise itself.",
        "",
    ]
    return "\n".join(out)


def _tok(token: int | None) -> str:
    return "end" if token is None else str(token)


def _yes_no(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "no")


def write_outputs(out_dir: Path, label: str, meta: dict[str, Any], results: Sequence[VariantResult]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = verdict(results)
    document = {"meta": meta, "verdict": summary, "variants": [asdict(r) for r in results]}
    json_path, md_path = out_dir / f"numerics_{label}.json", out_dir / f"numerics_{label}.md"
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    md_path.write_text(markdown(meta, results, summary))
    print("\n".join(summary["lines"]))
    return [json_path, md_path]


# ---- loading and the command line ----


def load_with_drafts(text: TargetText, dtype: str, sources: tuple[str, ...]) -> tuple[Target, Drafts]:
    """The target's weights in ``dtype``, and the draft_model source's head over them when ``sources`` use it."""
    target = text.with_model(dtype)
    # The head the drafter's config names by default (not $SPECSERVE_DRAFT_HEAD), in the dtype it would pick.
    path = Path(DrafterConfig().draft_head_path)
    head = load_head(target.model, target.fingerprint, path) if HeadProposer.name in sources else None
    return target, Drafts(sources, head)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.numerics", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=20, help="Spec-Bench prompts, round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the dtype whose noise floor is measured")
    parser.add_argument("--skip-fp32", action="store_true", help="skip E (speculative vs plain decoding in fp32)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target: 'smollm2' or a model path")
    parser.add_argument(
        "--sources",
        default=",".join(DrafterConfig().sources),
        help=f"D's draft sources, comma-separated from {', '.join(ALL_SOURCES)} (default: the drafter's)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="dtype",
        help="the engine's --weights for A-D (int8: the floor int8 weights must stay within; files end in "
        "_weights-int8)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/numerics"))
    parser.add_argument("--torch-threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    args.sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    if not args.sources or not set(args.sources) <= set(ALL_SOURCES):
        parser.error(f"--sources: choose from {', '.join(ALL_SOURCES)}")
    if args.prompts < 1 or args.max_new_tokens < 1 or args.torch_threads < 1:
        parser.error("--prompts, --max-new-tokens and --torch-threads must be at least 1")
    return args


def measure(
    load: Callable[[str], tuple[Target, Drafts]],
    cases: Sequence[Case],
    max_new_tokens: int,
    dtype: str,
    with_fp32: bool,
    weights: str = "dtype",
) -> list[VariantResult]:
    """A-D in ``dtype`` on ``weights`` and, unless that is fp32 on its own weights already or ``with_fp32`` is off,
    E (fp32 weights: int8 ones round like bf16); one model in memory at a time."""
    results = run_variants(*load(dtype), cases, max_new_tokens, weights)
    if with_fp32 and (dtype != "float32" or weights != "dtype"):
        results += run_fp32(*load("float32"), cases, max_new_tokens)
    elif with_fp32:  # the run is fp32 already: D against A is the fp32 check
        d = next(r for r in results if r.name == "D")
        results.append(replace(d, name="E", description="the run is fp32 already: E is D, compared with A"))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(args.torch_threads)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.describe(),
    }

    text = load_target_text(args.model)

    def load_in(dtype: str) -> tuple[Target, Drafts]:
        progress(f"loading {args.model} in {dtype}")
        try:
            return load_with_drafts(text, dtype, args.sources)
        except DraftHeadError as exc:
            raise SystemExit(f"error: the draft_model source needs its head: {exc} (or pass --sources)") from exc

    cases = make_cases(text.tokenizer, CATEGORIES, args.prompts)
    results = measure(load_in, cases, args.max_new_tokens, args.dtype, not args.skip_fp32, args.weights)
    meta["settings"] = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "prompts": len(cases),
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "sources": list(args.sources),
        "fp32_check": not args.skip_fp32,
        "cases": [
            {"index": c.index, "category": c.category, "question_id": c.question_id, "prompt_tokens": len(c.token_ids)}
            for c in cases
        ],
    }
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["machine"]["load_average_at_end"] = machine.load_average()
    label = args.dtype if args.weights == "dtype" else f"{args.dtype}_weights-{args.weights}"
    paths = write_outputs(args.out_dir, label, meta, results)
    progress(f"wrote {', '.join(str(p) for p in paths)} in {meta['duration_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
