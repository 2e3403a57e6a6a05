"""bench.verify_cost on a tiny random model: the measurement loop and its summary, not the timings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.verify_cost import measure, summarize
from target_service.verifier import Verifier


def tiny_verifier(max_nodes: int) -> Verifier:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return Verifier(LlamaForCausalLM(config).eval(), "tiny", max_tree_nodes=max_nodes, max_tree_depth=max_nodes)


def test_every_size_is_timed_reps_times_on_a_context_that_grows_slowly() -> None:
    sizes, reps, warmup, context = [1, 2, 8], 3, 1, 32
    by_shape, longest = measure(tiny_verifier(max(sizes)), context, sizes, reps, warmup)
    assert sorted(by_shape) == ["chain", "tree"]
    for times in by_shape.values():
        assert sorted(times) == sizes
        assert all(len(samples) == reps and min(samples) > 0 for samples in times.values())
    # Each verify commits at least its bonus token: the context grows by one or more per repetition.
    assert context + warmup + reps - 1 <= longest <= context + (warmup + reps) * max(sizes)


def test_summary_is_relative_to_plain_decoding() -> None:
    rows = summarize({1: [0.002, 0.004, 0.003], 4: [0.006, 0.006, 0.009]})
    assert [r["tokens"] for r in rows] == [1, 4]
    assert [r["tree_nodes"] for r in rows] == [0, 3]
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == 2.0  # medians 6 ms / 3 ms
    assert rows[1]["p10_ms"] <= rows[1]["median_ms"] <= rows[1]["p90_ms"]


def test_tree_shape_branches_with_the_same_node_count() -> None:
    from bench.verify_cost import draft_tree

    tree = draft_tree("tree", [5, 6, 7, 8, 9])
    assert tree.parents == (-1, 0, 0, 1, 1)
    assert not tree.is_chain() and len(tree) == len(draft_tree("chain", [5, 6, 7, 8, 9]))


def test_batched_steps_share_one_forward_and_are_relative_to_one_plain_session() -> None:
    from bench.verify_cost import measure_batched, summarize_batched

    batch_sizes, nodes, reps, warmup, context = [1, 2, 4], [0, 3], 2, 1, 16
    verifier = tiny_verifier(8)
    try:
        batched = measure_batched(verifier, context, batch_sizes, nodes, reps, warmup)
    finally:
        verifier.close()
    cases = [(b, k) for b in batch_sizes for k in nodes]
    assert sorted(batched.times) == cases
    assert all(len(samples) == reps and min(samples) > 0 for samples in batched.times.values())
    # The engine was paused while the B calls queued: each step served all of them in one forward.
    assert batched.unshared == dict.fromkeys(cases, 0)
    assert all(batched.batch_sessions_seen[(b, k)] == [b] * reps for b, k in cases)
    # Least-grown sessions first: no session's context runs far ahead of the others.
    steps = (warmup + reps) * len(cases)
    assert context <= batched.longest_context <= context + steps * (max(nodes) + 1)
    rows = summarize_batched(batched)
    assert [(r["sessions"], r["draft_nodes"], r["tokens"]) for r in rows] == [(b, k, b * (k + 1)) for b, k in cases]
    assert rows[0]["ratio"] == 1.0
    assert all(r["ms_per_session"] == r["median_ms"] / r["sessions"] for r in rows)


def test_arguments_measure_both_dtypes_by_default() -> None:
    from bench.verify_cost import parse_args

    args = parse_args([])
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.batch_sizes == [1, 2, 4, 8, 16] and args.batch_draft_nodes == [0, 1, 3, 7]
    assert parse_args(["--dtype", "bfloat16"]).dtypes == ["bfloat16"]  # the old flag still works
    assert parse_args(["--batch-sizes", ""]).batch_sizes == []


def test_int8_weights_are_measured_with_the_packed_step_and_named_apart(tmp_path: Path) -> None:
    """``--weights dtype,int8``: int8 only where it runs (compile auto on a CPU), in files of its own."""
    from bench.verify_cost import main

    flags = "--shape smollm2-135m --num-layers 1 --dtypes float32 --compile auto,off --weights dtype,int8"
    flags += " --sizes 1,2 --reps 1 --warmup 0 --context 8"
    main([*flags.split(), "--batch-sizes", "", "--out-dir", str(tmp_path)])
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == [
        "verify_cost_smollm2-135m-1layers_cpu_float32_compile-auto.json",
        "verify_cost_smollm2-135m-1layers_cpu_float32_compile-auto_weights-int8.json",
        "verify_cost_smollm2-135m-1layers_cpu_float32_compile-off.json",
    ]
    settings = json.loads((tmp_path / names[1]).read_text())["meta"]["settings"]
    assert settings["weights"] == "int8" and "int8" in settings["step_form"]
