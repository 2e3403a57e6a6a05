"""``--compile inductor``: the whole step compiled (tiny models, fp32), held to transformers and to itself.

Each model compiles once (tens of seconds on 2 cores), so the cases share a module-scoped runner.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.step_invariance import RowProbe
from target_service.inductor_steps import INDUCTOR_ROW_BUCKETS, InductorSteps
from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan
from tests.unit.test_llama_forward import CPU, PROMPTS, TREES, build, expected_rows, reference_logits, tree_step

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, ModelRunner]:
    """Qwen3: per-head Q and K norms, the most the shared forward does; compiled at "start-up"."""
    model = build("qwen3")
    runner = ModelRunner(model, "inductor")
    assert runner.compiles_steps and not runner.captures_steps
    return model, runner


def test_the_compiled_step_equals_transformers_on_ragged_trees(qwen3: tuple[Any, ModelRunner]) -> None:
    model, runner = qwen3
    arena = runner.new_arena(1024)
    assert runner.prepare_steps(arena, 256, 1024) == 1
    arena.allocate(200)  # the sessions' regions do not start at slot 0: the window gathers them from elsewhere
    # Prefill chunks of 6, 3 and 1 rows, then one step of 11 rows (three sessions, two trees): buckets 8, 4, 2, 16.
    logits = tree_step(runner, PROMPTS, TREES, arena)
    torch.testing.assert_close(logits, expected_rows(model).float(), atol=1e-5, rtol=1e-5)
    assert "inductor" in runner.describe()


def test_padding_rows_write_only_the_scratch_slot(qwen3: tuple[Any, ModelRunner]) -> None:
    """A 3-row step runs as 4 (and one row as 2): padding rows write their keys to the scratch slot alone."""
    model, runner = qwen3
    for tokens in ([5, 9, 2], [5]):
        arena = runner.new_arena(64)
        assert arena.scratch_slot == 64
        for tensor in (*arena.keys, *arena.values):
            tensor[:, :64].fill_(7.0)
        region = arena.allocate(16)
        assert region is not None
        plan = StepPlan(arena, [Segment.chunk(region, 0, slice(0, len(tokens)), CPU)])
        rows = torch.arange(len(tokens))
        logits = runner.forward(plan, torch.tensor(tokens), torch.arange(len(tokens)), rows, rows[:0]).logits
        torch.testing.assert_close(logits, reference_logits(model, tokens), atol=1e-5, rtol=1e-5)
        for tensor in (*arena.keys, *arena.values):
            assert torch.all(tensor[:, len(tokens) : 64] == 7.0), "a padding row wrote into a region's slots"


def test_one_graph_serves_every_bucket_and_window(qwen3: tuple[Any, ModelRunner]) -> None:
    """Dynamic shapes: after start-up, no row count or window compiles again (a compile in a request's round
    would stall every session for tens of seconds)."""
    _, runner = qwen3
    steps = runner._static
    assert isinstance(steps, InductorSteps)
    probe = RowProbe(runner, vocab=96, most_rows=64)
    assert steps.row_buckets == INDUCTOR_ROW_BUCKETS and 1 not in steps.row_buckets  # one row runs as two
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    assert before >= 1, "the fixture's start-up compiled the step"
    for rows in (1, 3, 8, 33):
        probe.step(rows, 0)
        probe.step(rows, 5)
    assert graphs["unique_graphs"] == before


def test_a_row_alone_and_inside_larger_buckets_stays_within_rounding(qwen3: tuple[Any, ModelRunner]) -> None:
    """Bits are not promised here (the window attention rounds by how many rows and slots it covers); the
    difference is reported by ``bench.step_invariance --compile inductor`` and must stay at rounding."""
    _, runner = qwen3
    probe = RowProbe(runner, vocab=96, most_rows=64)
    alone = probe.step(1, 0)
    for total in (2, 4, 16, 64):
        torch.testing.assert_close(probe.step(1, total - 1), alone, atol=1e-5, rtol=1e-5)


def test_inductor_is_refused_where_it_does_not_run() -> None:
    model = build("llama")
    with pytest.raises(ValueError, match="inductor"):
        ModelRunner(model, "inductor", static=True)
    with pytest.raises(ValueError, match="int8"):
        ModelRunner(model, "inductor", weights="int8")
