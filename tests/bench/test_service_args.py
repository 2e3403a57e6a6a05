"""What the benchmarks append to the services' command lines: ``--device`` reaches the verifier and the drafter.

Parses arguments only; starts nothing and needs no GPU (``--device cuda`` is checked by the services themselves).
"""

from __future__ import annotations

from bench import load, run
from bench.modes import InProcessMode
from tests.conftest import tiny_llama


def value_of(words: list[str], flag: str) -> str:
    """The value of the last ``flag`` in ``words`` (what argparse keeps)."""
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == flag][-1]


def test_bench_run_starts_the_distributed_drafter_on_the_run_device(packaged_model: None) -> None:
    device = ["--device", "cuda:1", "--dtype", "bfloat16"]
    args = run.parse_args(
        [*device, "--modes", "baseline,distributed", "--drafter-arg=--sources prompt_lookup,ngram_pool"]
    )
    verifier, drafter = run.service_args(args, "distributed", "bfloat16")
    assert value_of(verifier, "--device") == value_of(drafter, "--device") == "cuda:1"
    assert value_of(verifier, "--dtype") == "bfloat16"
    assert drafter[-2:] == ["--sources", "prompt_lookup,ngram_pool"]  # --drafter-arg comes last: it wins
    assert args.drafter_config.sources == ("prompt_lookup", "ngram_pool")
    assert not run.uses_head(args.modes, args.drafter_config.sources)  # the report names no head it did not run


def test_bench_run_keeps_the_drafter_on_the_cpu_by_default(packaged_model: None) -> None:
    args = run.parse_args(["--dtype", "float32", "--modes", "distributed-no-predraft"])
    verifier, drafter = run.service_args(args, "distributed-no-predraft", "float32")
    assert value_of(verifier, "--device") == value_of(drafter, "--device") == "cpu"
    assert value_of(drafter, "--predraft-outcomes") == "0"
    assert run.uses_head(args.modes, args.drafter_config.sources)


def test_bench_load_puts_the_verifier_and_drafter_on_its_device() -> None:
    args = load.parse_args(["--device", "cuda", "--verifier-arg=--dtype bfloat16", "--drafter-arg=--device cpu"])
    verifier, drafter = load.service_args(args)
    assert value_of(verifier, "--device") == "cuda" and value_of(verifier, "--dtype") == "bfloat16"
    assert value_of(drafter, "--device") == "cpu"  # a --drafter-arg saying otherwise wins
    assert load.service_args(load.parse_args([]))[1] == ["--device", "cpu"]


def test_the_in_process_modes_draft_with_the_drafter_settings_the_distributed_drafter_gets() -> None:
    """A tree shape given with --drafter-arg shapes ``inproc``'s trees too (two modes, one comparison); the
    mode's own sources still win over the words' (``inproc:a+b`` names them)."""
    args = run.parse_args(["--modes", "inproc:suffix", "--drafter-arg=--tree-depth 2 --tree-beam 1 --sources suffix"])
    model = tiny_llama(vocab_size=64, seed=3, layers=2, context=128)
    mode = InProcessMode(model, None, "fp", frozenset({0}), ("prompt_lookup",), drafter_config=args.drafter_config)
    config = mode._drafter_config
    assert (config.tree_depth, config.tree_beam, config.sources) == (2, 1, ("prompt_lookup",))
