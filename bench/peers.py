"""specserve against llama.cpp on a CPU: ``python -m bench.peers`` (``make bench-peers``).

llama.cpp is what a CPU user would pick instead, so this measures the ratio
that matters there. On the same Spec-Bench prompts (chat template applied, the
same token ids into every engine), greedy, up to ``--max-new-tokens`` each,
stopping at EOS, interleaved prompt by prompt (the order rotating):

- ``llama.cpp``: llama-cpp-python on the GGUF the service loads (Q4_1 as shipped), in a process of its
  own (``LlamaCppProcess``);
- ``plain-float32``: plain greedy decoding through specserve's verifier engine
  (``Verifier.verify`` with empty trees), the GGUF de-quantized to fp32;
- ``plain-<dtype>``: the same in the dtype ``--dtype auto`` picks here (skipped when that is fp32);
- ``speculative-<dtype>``: specserve's speculative decoding in process
  (``bench.modes.InProcessMode``), in that dtype;
- ``distributed-<dtype>``: specserve as it is deployed, the coordinator, a drafter and a verifier (started
  with that ``--dtype``, every other flag at its default) as three processes on loopback with the drafters'
  Redis n-gram pool, through the client SDK (``bench.modes.DistributedMode``); ``--no-distributed`` leaves
  it out.

Reports decode and total tokens/s, each mode's ratio to llama.cpp, and whether
llama.cpp's tokens equal specserve's fp32 plain decoding per prompt (reported,
not required: different weights and kernels). Writes ``peers.json`` and
``peers.md`` to ``--out-dir``. llama-cpp-python is not a project dependency:
``make bench-peers`` builds it into the venv first (``make bench-peers-install``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import multiprocessing
import re
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from draft_service.config import DrafterConfig
from draft_service.draft_head import DraftHeadError
from draft_service.drafter import ALL_SOURCES
from draft_service.head_proposer import HeadProposer
from specserve.block_weights import choose_model_dtype
from specserve.model_loading import DEFAULT_MODEL, ModelSource, resolve_model
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.engine_threads import serve_on_this_thread
from target_service.verifier import Verifier

from . import machine
from .cluster import DEFAULT_REDIS_URL, PoolBackend, choose_pool, pool_reset, start_cluster
from .dataset import CATEGORIES, expand_categories
from .modes import DistributedMode, InProcessMode, Prompt
from .peers_report import LLAMA_CPP, ModeResult, Run, borrow_prompt_times, leaderboard, write_outputs
from .target import (
    FLOAT32,
    WARM_UP_TEXT,
    WARM_UP_TOKENS,
    Case,
    TargetText,
    chat_ids,
    load_head,
    load_target_text,
    make_cases,
    model_dtype,
    progress,
    quiet_libraries,
)

NOT_INSTALLED = "llama-cpp-python is not installed: run `make bench-peers` (it builds it)"
# Written by `make bench-peers-install` next to the venv's python: the version and CMAKE_ARGS it was built with.
BUILD_FILE = "llama-cpp-python-build.txt"
DTYPES = ("auto", FLOAT32, "bfloat16", "float16")
GREEDY = SamplingParams()


@dataclass
class _Output:
    """Output tokens as they come, cut at the first EOS (not kept) and at the token limit."""

    max_new_tokens: int
    eos_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    eos: bool = False

    @property
    def done(self) -> bool:
        return self.eos or len(self.tokens) >= self.max_new_tokens

    def take(self, new: Sequence[int]) -> None:
        for token in new:
            if self.done:
                return
            if token in self.eos_ids:
                self.eos = True
                return
            self.tokens.append(token)


class Engine(Protocol):
    name: str
    engine: str
    dtype: str

    def run(self, prompt: Prompt) -> Run: ...

    def close(self) -> None: ...


# ---- the engines ----


class LlamaCppEngine:
    """llama-cpp-python's ``Llama`` on the GGUF: ``eval`` the prompt but its last token, then ``generate`` greedily.

    ``generate`` is given the last prompt token with ``reset=False``, so it
    decodes on top of the evaluated prompt exactly as the verifier decodes on
    top of its prefill; ``reset()`` first keeps its prefix cache from reusing
    the previous prompt's KV cache (specserve starts every prompt cold too).
    """

    name = LLAMA_CPP
    engine = "llama-cpp-python Llama.generate, greedy"

    def __init__(self, llama_cpp: Any, gguf: Path, threads: int, n_ctx: int, eos_ids: frozenset[int]) -> None:
        self.dtype = gguf_quantization(gguf)
        self._llm: Any = llama_cpp.Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,  # the prompt's threads; llama-cpp-python's default is every CPU
            n_ctx=n_ctx,
            verbose=False,
            seed=0,
        )
        self._eos_ids = eos_ids

    @property
    def n_vocab(self) -> int:
        return int(self._llm.n_vocab())

    def run(self, prompt: Prompt) -> Run:
        token_ids = prompt.token_ids
        out = _Output(prompt.max_new_tokens, self._eos_ids)
        start = time.perf_counter_ns()
        self._llm.reset()
        self._llm.eval(token_ids[:-1])
        prompt_ns = time.perf_counter_ns() - start
        tokens = self._llm.generate(token_ids[-1:], top_k=1, temp=0.0, repeat_penalty=1.0, reset=False)
        for token in tokens:  # one forward per token; leaving the loop stops it (no forward after the last)
            out.take([int(token)])
            if out.done:
                break
        total_ns = time.perf_counter_ns() - start
        tokens.close()
        return Run(out.tokens, out.eos, total_ns, prompt_ns, len(out.tokens) + int(out.eos))

    def close(self) -> None:
        close = getattr(self._llm, "close", None)
        if close is not None:
            close()


class PlainEngine:
    """Plain greedy decoding through specserve's verifier engine: prefill, then one empty-tree Verify per token."""

    engine = "specserve verifier, plain greedy (empty trees)"

    def __init__(self, model: Any, fingerprint: str, eos_ids: frozenset[int], threads: int = 0) -> None:
        self._verifier = Verifier(model, fingerprint, engine_threads=threads)
        self._verifier.park()  # one engine thread (one OpenMP team) in the process at a time: Verifier.park
        self.dtype = self._verifier.dtype
        self.name = f"plain-{self.dtype}"
        self._eos_ids = eos_ids

    def run(self, prompt: Prompt) -> Run:
        session_id = f"peers-{uuid.uuid4().hex}"
        out = _Output(prompt.max_new_tokens, self._eos_ids)
        start = time.perf_counter_ns()
        self._verifier.prefill(session_id, prompt.token_ids, GREEDY)
        prompt_ns = time.perf_counter_ns() - start
        committed, forwards = len(prompt.token_ids), 0
        try:
            while not out.done:
                new = self._verifier.verify(session_id, committed, TokenTree()).committed
                committed += len(new)
                forwards += 1
                out.take(new)
            total_ns = time.perf_counter_ns() - start
        finally:
            self._verifier.release(session_id)
            self._verifier.park()
        return Run(out.tokens, out.eos, total_ns, prompt_ns, forwards)

    def close(self) -> None:
        self._verifier.close()


class ModeEngine:
    """specserve's speculative decoding through a ``bench.modes`` mode: in process (``InProcessMode``, the
    services' defaults; named ``speculative-<dtype>``) or as deployed, the coordinator, drafter and verifier
    processes over gRPC (``DistributedMode``; ``distributed-<dtype>``, the figure #30 reads against llama.cpp).

    Neither times its prefill apart (a distributed run times the whole request, the verifier's prefill
    inside it), so runs carry ``prompt_ns`` 0 and the harness puts in the plain engine's prefill time on the
    same prompt in the same dtype (``borrow_prompt_times``). The n-gram pool (the in-process drafter's, or the
    drafters' Redis pool) is emptied after the warm-up and learns from one prompt to the next, as in
    ``bench.run``.
    """

    def __init__(self, mode: InProcessMode | DistributedMode, dtype: str) -> None:
        self._mode = mode
        self.dtype = dtype
        if isinstance(mode, DistributedMode):
            self.name = f"distributed-{dtype}"
            self.engine = "specserve coordinator + drafter + verifier processes over gRPC (DistributedMode)"
        else:
            self.name = f"speculative-{dtype}"
            self.engine = "specserve in process: drafter + round loop (InProcessMode)"

    def run(self, prompt: Prompt) -> Run:
        outcome = self._mode.run(prompt)
        if outcome.note:
            progress(f"[{self.name}] note: {outcome.note}")
        return Run(outcome.tokens, outcome.eos, outcome.wall_ns, 0, outcome.rounds)

    def reset(self) -> None:
        self._mode.reset()

    def close(self) -> None:
        self._mode.close()


def gguf_quantization(gguf: Path) -> str:
    """The quantization a GGUF's file name states (``SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1), else "gguf"."""
    found = re.search(r"[.-](I?Q\d\w*|B?F(16|32))$", gguf.stem, flags=re.IGNORECASE)
    return found.group(1) if found else "gguf"


# ---- llama.cpp itself ----


_CHILD_ENGINE: LlamaCppEngine | None = None  # in the llama.cpp process: its engine


def _start_llama_cpp(gguf: Path, threads: int, n_ctx: int, eos_ids: frozenset[int]) -> None:
    global _CHILD_ENGINE
    _CHILD_ENGINE = LlamaCppEngine(importlib.import_module("llama_cpp"), gguf, threads, n_ctx, eos_ids)


def _llama_cpp_call(method: str, *args: Any) -> Any:
    assert _CHILD_ENGINE is not None
    attribute = getattr(_CHILD_ENGINE, method)
    return attribute(*args) if callable(attribute) else attribute


class LlamaCppProcess:
    """``LlamaCppEngine`` in a process of its own, as a CPU user runs llama.cpp.

    In the benchmark's own process, llama.cpp's threads (its OpenMP runtime, not torch's) slowed every later
    specserve step: plain bf16 decoding on a 2-core AVX512-BF16 EPYC took 12.3-12.9 ms a token before the
    first llama.cpp generation in the process and 21.6-22.0 ms after it, a second later too. In a child
    process each engine computes as it would alone; the child idles while the others run.
    """

    name = LLAMA_CPP
    engine = LlamaCppEngine.engine

    def __init__(self, gguf: Path, threads: int, n_ctx: int, eos_ids: frozenset[int]) -> None:
        self.dtype = gguf_quantization(gguf)
        self._pool = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_llama_cpp,
            initargs=(gguf, threads, n_ctx, eos_ids),
        )
        self.n_vocab: int = self._call("n_vocab")  # the model loads here, not in the first timed run

    def _call(self, method: str, *args: Any) -> Any:
        return self._pool.submit(_llama_cpp_call, method, *args).result()

    def run(self, prompt: Prompt) -> Run:
        run: Run = self._call("run", prompt)
        return run

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._pool.shutdown()


def import_llama_cpp() -> Any | None:
    """The ``llama_cpp`` module, or None when llama-cpp-python is not installed (it is opt-in)."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        return None


def llama_cpp_info(llama_cpp: Any) -> dict[str, Any]:
    """Version, the flags ``make bench-peers-install`` built it with, and the CPU features compiled in."""
    build_file = Path(sys.prefix) / BUILD_FILE
    try:
        system_info = llama_cpp.llama_print_system_info()
        system_info = system_info.decode() if isinstance(system_info, bytes) else str(system_info)
    except Exception as exc:  # informative only; an older binding may lack it
        system_info = f"unavailable ({type(exc).__name__})"
    return {
        "version": getattr(llama_cpp, "__version__", "unknown"),
        "build_flags": build_file.read_text().strip() if build_file.is_file() else "",
        "build_file": f"<venv>/{BUILD_FILE}" if build_file.is_file() else "",  # no machine path in a report
        "system_info": system_info.strip(),
    }


# ---- prompts, models, the run ----


def gguf_path(source: ModelSource) -> Path:
    if source.gguf_file is None:
        raise SystemExit(f"error: llama.cpp needs a GGUF file; {source.name} is a Hugging Face directory")
    return source.directory / source.gguf_file


def speculative_engine(
    model: Any, tokenizer: Any, fingerprint: str, eos_ids: frozenset[int], sources: tuple[str, ...], threads: int = 0
) -> ModeEngine:
    try:
        # The head the drafter's config names by default (not $SPECSERVE_DRAFT_HEAD), in the dtype it would pick.
        path = Path(DrafterConfig().draft_head_path)
        head = load_head(model, fingerprint, path) if HeadProposer.name in sources else None
    except DraftHeadError as exc:
        raise SystemExit(f"error: the draft_model source needs its head: {exc} (or pass --sources)") from exc
    mode = InProcessMode(model, tokenizer, fingerprint, eos_ids, sources, head, threads=threads)
    return ModeEngine(mode, model_dtype(model))


def measure(engines: Sequence[Engine], cases: Sequence[Case], max_new_tokens: int) -> tuple[dict[str, list[Run]], str]:
    """Every engine on every case, the order of the engines rotating from one prompt to the next.

    Returns the runs of the prompts every engine finished, and the error that stopped it early ("" when none).
    """
    runs: dict[str, list[Run]] = {e.name: [] for e in engines}
    try:
        for case in cases:
            k = case.index % len(engines)
            prompt = Prompt(case.text, case.token_ids, max_new_tokens, GREEDY)
            done = {e.name: e.run(prompt) for e in [*engines[k:], *engines[:k]]}
            for name, run in done.items():
                runs[name].append(run)
            rates = ", ".join(f"{name} {len(r.tokens) / max(r.total_ns, 1) * 1e9:.1f}" for name, r in done.items())
            progress(f"prompt {case.index + 1}/{len(cases)} ({case.category} #{case.question_id}): tok/s {rates}")
    except KeyboardInterrupt:
        return runs, "interrupted"
    except Exception as exc:  # keep what was measured; the error goes into the report
        return runs, f"{type(exc).__name__}: {exc}"
    return runs, ""


def results_of(engines: Sequence[Engine], runs: dict[str, list[Run]], fp32_name: str) -> list[ModeResult]:
    """The modes' results: llama.cpp compared with fp32 plain decoding, speculative with plain in its own dtype."""
    results = []
    for e in engines:
        mode = ModeResult(e.name, e.engine, e.dtype, runs[e.name])
        if e.name == LLAMA_CPP or (e.name.startswith("plain-") and e.name != fp32_name):
            mode.identical_to = fp32_name
        elif isinstance(e, ModeEngine):
            plain = f"plain-{e.dtype}"
            mode.identical_to = plain
            mode.prompt_time_from = plain
            mode.runs = borrow_prompt_times(mode.runs, runs[plain])
        results.append(mode)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.peers", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--prompts", type=int, default=20, help="Spec-Bench prompts (fewer when the category has fewer)"
    )
    parser.add_argument(
        "--category",
        default="coding",
        help=f"a category, a comma-separated list, 'mt_bench' or 'all' (round-robin over {', '.join(CATEGORIES)})",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp n_threads and torch threads alike")
    parser.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context; longer prompts are skipped")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="specserve's dtype besides fp32 (auto: the verifier's pick here)",
    )
    parser.add_argument(
        "--sources",
        default=",".join(DrafterConfig().sources),
        help=f"speculative draft sources, comma-separated from {', '.join(ALL_SOURCES)} (default: the drafter's)",
    )
    parser.add_argument(
        "--distributed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run specserve's three processes (coordinator, drafter, verifier on loopback)",
    )
    parser.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="the three processes' n-gram pool ('' for the drafter's in-memory one); its keys for this "
        "vocabulary are deleted after the warm-up",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (the packaged GGUF) or a .gguf path")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/peers"))
    args = parser.parse_args(argv)
    try:
        args.categories = expand_categories(
            CATEGORIES if args.category == "all" else [c.strip() for c in args.category.split(",") if c.strip()]
        )
    except ValueError as exc:
        parser.error(str(exc))
    args.sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    args.distributed_pool = None
    if not args.sources or not set(args.sources) <= set(ALL_SOURCES):
        parser.error(f"--sources: choose from {', '.join(ALL_SOURCES)}")
    if min(args.prompts, args.max_new_tokens, args.threads, args.n_ctx) < 1:
        parser.error("--prompts, --max-new-tokens, --threads and --n-ctx must be at least 1")
    return args


def select_cases(args: argparse.Namespace, target: TargetText) -> tuple[list[Case], list[int]]:
    """The prompts to measure, and the question ids skipped for not fitting llama.cpp's context."""
    found = make_cases(target.tokenizer, args.categories, args.prompts)
    if len(found) < args.prompts:
        progress(f"{args.category} holds {len(found)} prompts: measuring those (of {args.prompts} asked for)")
    fits = [c for c in found if len(c.token_ids) + args.max_new_tokens <= args.n_ctx]
    too_long = [c.question_id for c in found if c not in fits]
    if too_long:
        progress(f"skipping questions {too_long}: prompt + {args.max_new_tokens} tokens exceed --n-ctx {args.n_ctx}")
    return [replace(c, index=i) for i, c in enumerate(fits)], too_long


def build_engines(
    args: argparse.Namespace, gguf: Path, target: TargetText, dtype: str, stack: ExitStack
) -> list[Engine]:
    """llama.cpp, plain fp32, plain in ``dtype`` (unless fp32), speculative in ``dtype``, in one process and
    (``--distributed``) in three; the stack closes them."""
    engines: list[Engine] = []

    def add(engine: Engine) -> None:
        stack.callback(engine.close)
        engines.append(engine)

    progress(f"loading {gguf} into llama.cpp ({args.threads} threads)")
    add(LlamaCppProcess(gguf, args.threads, args.n_ctx, target.eos_ids))
    progress(f"loading {target.source.name} in {FLOAT32}" + ("" if dtype == FLOAT32 else f" and {dtype}"))
    fp32_model = target.load_model(FLOAT32)
    add(PlainEngine(fp32_model, target.fingerprint, target.eos_ids, args.engine_threads))
    model = fp32_model if dtype == FLOAT32 else target.load_model(dtype)
    if model is not fp32_model:
        add(PlainEngine(model, target.fingerprint, target.eos_ids, args.engine_threads))
    add(
        speculative_engine(
            model, target.tokenizer, target.fingerprint, target.eos_ids, args.sources, args.engine_threads
        )
    )
    if args.distributed:
        add(distributed_engine(args, target, dtype, stack))
    return engines


def distributed_engine(args: argparse.Namespace, target: TargetText, dtype: str, stack: ExitStack) -> ModeEngine:
    """The three processes with the verifier in ``dtype`` on ``--threads`` torch threads, the rest as ``make run``."""
    pool: PoolBackend = choose_pool(args.redis_url)
    args.distributed_pool = pool.description  # for the report's settings
    progress(f"starting the coordinator, drafter and verifier ({dtype}); n-gram pool: {pool.description}")
    log_dir = args.out_dir / "tmp" / "cluster-logs"
    cluster = start_cluster(target.name, pool, args.threads, log_dir, verifier_args=["--dtype", dtype])
    stack.callback(cluster.stop)
    return ModeEngine(DistributedMode(cluster.coordinator_address, dtype, pool_reset(pool, target.fingerprint)), dtype)


def warm_up(engines: Sequence[Engine], tokenizer: Any) -> None:
    """One short unrelated generation per engine (one-off start-up costs), then empty the n-gram pools."""
    ids = chat_ids(tokenizer, WARM_UP_TEXT)
    for engine in engines:
        engine.run(Prompt(WARM_UP_TEXT, ids, WARM_UP_TOKENS, GREEDY))
        if isinstance(engine, ModeEngine):
            engine.reset()


def settings(
    args: argparse.Namespace, gguf: Path, target: TargetText, cases: Sequence[Case], too_long: list[int]
) -> dict[str, Any]:
    choice = choose_model_dtype(args.dtype, "cpu", resolve_model(args.model))
    return {
        "model": args.model,
        "model_source": machine.portable_path(gguf),
        "category": args.category,
        "categories": args.categories,
        "prompts_requested": args.prompts,
        "prompts": len(cases),
        "skipped_too_long": too_long,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "auto_dtype": choice.dtype,
        "auto_dtype_reason": choice.reason,
        "sources": list(args.sources),
        "distributed_pool": args.distributed_pool,  # None where the three processes did not run
        "eos_token_ids": sorted(target.eos_ids),
        "vocab_size_tokenizer": len(target.tokenizer),
        "cases": [
            {"index": c.index, "category": c.category, "question_id": c.question_id, "prompt_tokens": len(c.token_ids)}
            for c in cases
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    llama_cpp = import_llama_cpp()
    if llama_cpp is None:
        print(NOT_INSTALLED, file=sys.stderr)
        return 2
    quiet_libraries()
    torch.set_num_threads(args.threads)
    # One OpenMP team at a time, as a service runs: the engines' threads compute on --threads, this one (model
    # loading, the in-process drafter's head) on one (target_service.engine_threads; bench.run does the same).
    # With a team of its own here as well, every engine step ran about 1.5x slower.
    args.engine_threads = serve_on_this_thread()
    started = time.monotonic()
    meta: dict[str, Any] = {
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.describe(),
        "llama_cpp": llama_cpp_info(llama_cpp),
    }
    gguf = gguf_path(resolve_model(args.model))
    target = load_target_text(args.model)
    cases, too_long = select_cases(args, target)
    dtype = choose_model_dtype(args.dtype, "cpu", resolve_model(args.model)).dtype
    with ExitStack() as stack:
        engines = build_engines(args, gguf, target, dtype, stack)
        meta["llama_cpp"]["n_vocab"] = next(e.n_vocab for e in engines if isinstance(e, LlamaCppProcess))
        warm_up(engines, target.tokenizer)
        runs, error = measure(engines, cases, args.max_new_tokens)
    done = min(len(r) for r in runs.values())
    runs = {name: r[:done] for name, r in runs.items()}
    meta["settings"] = settings(args, gguf, target, cases[:done], too_long)
    meta.update(complete=not error, error=error, duration_s=round(time.monotonic() - started, 1))
    meta["machine"]["load_average_at_end"] = machine.load_average()
    meta["machine"]["cpu_steal"] = machine.steal_since(meta["machine"].get("cpu_times_at_start"))
    results = results_of(engines, runs, f"plain-{FLOAT32}")
    summaries, paths = write_outputs(args.out_dir, meta, results, min(target.eos_ids))
    print("\n".join(leaderboard(summaries)))
    progress(f"wrote {', '.join(str(p) for p in paths)} in {meta['duration_s']:.0f} s")
    if error:
        progress(f"stopped early ({error}); the outputs hold the {done} prompts every engine finished")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
