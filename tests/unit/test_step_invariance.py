"""Batch invariance: a row's result is the same bits however many rows share its step (fp32, GGUF blocks, bf16).

Greedy speculation is token-identical to plain decoding only if a token
scored inside a tree gets exactly the logits it gets in a plain one-token
step. The engine runs its products on a prepacked GEMM (oneDNN or MKL) and
only at the row counts at which that kernel computes each row alike on this
CPU (``packed_linear.row_invariant_rows``), padding other steps up to one;
these tests check the result on the machine they run on, at every row count
up to the largest.
"""

from __future__ import annotations

import pytest
import torch

from bench.step_invariance import RowProbe
from specserve.block_weights import block_kernels
from specserve.packed_linear import ONEDNN_ROWS, available_packing
from target_service import llama_forward
from target_service.model_runner import ModelRunner
from tests.conftest import gguf_like, tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    available_packing(torch.float32, CPU) == "none", reason="no packed GEMM in this torch build"
)


@pytest.fixture(
    scope="module",
    params=[
        torch.float32,
        pytest.param("blocks", marks=pytest.mark.skipif(block_kernels() is None, reason="no block kernel here")),
        pytest.param(  # bf16 layers on oneDNN, the head's fp32 products on fp16-stored weights (FBGEMM)
            torch.bfloat16,
            marks=pytest.mark.skipif(
                available_packing(torch.bfloat16, CPU) == "none", reason="this CPU has no bf16 packing"
            ),
        ),
    ],
)
def bench(request: pytest.FixtureRequest) -> RowProbe:
    """The probe; ``probe.form`` names the step form (the fixture's parameter)."""
    torch.manual_seed(0)
    if request.param == "blocks":  # fp32 products over Q4_1 / Q8_0 blocks, as the packaged GGUF model runs them
        # heads of 32 values: whole vector registers, so norms, rotary and attention run in the kernel too
        runner = ModelRunner(gguf_like(tiny_llama(vocab_size=64, seed=5, layers=2, hidden=128)), "auto")
        assert runner.packing == "blocks" and "verifies' attention" in runner.describe()
        probe = RowProbe(runner, vocab=64)
    else:
        model = tiny_llama(vocab_size=64, seed=5, layers=2).to(request.param)
        probe = RowProbe(ModelRunner(model, "auto"), vocab=64)
    probe.form = str(request.param)
    return probe


@pytest.mark.parametrize("own_rows", [1, 3])
def test_rows_get_the_same_bits_at_every_row_count(bench: RowProbe, own_rows: int) -> None:
    alone = bench.step(own_rows, 0)
    for total in range(own_rows + 1, max(ONEDNN_ROWS) + 1):
        shared = bench.step(own_rows, total - own_rows)
        assert torch.equal(shared, alone), (
            f"{own_rows} rows alone and in a {total}-row step differ by {(shared - alone).abs().max():.3g}"
        )


def test_rows_beyond_the_largest_bucket_stay_within_rounding(bench: RowProbe) -> None:
    """Past the largest row count checked, bit equality is not promised: equal to rounding."""
    alone = bench.step(1, 0)
    torch.testing.assert_close(bench.step(1, max(ONEDNN_ROWS) + 7), alone, atol=1e-5, rtol=1e-5)


def test_a_chain_scored_in_one_step_gets_plain_decodings_bits_on_the_blocks(bench: RowProbe) -> None:
    """Over the GGUF blocks a verify's rows attend in the kernel (``block_weights.attend_rows``): each of n chain
    rows scored in one step has the logits of the same token decoded alone after the ones before it (in steps of
    up to the kernel's 32 rows: wider steps' products run on oneDNN)."""
    if bench.form != "blocks":
        pytest.skip("SDPA attends a segment's rows together: equal to rounding only (bench.step_invariance)")
    for n in (2, 5, 17, 29):
        together = bench.step(n, 3)  # three other sessions' rows in the step too
        for i in range(n):
            decoded = bench.step(1, 0, after=i)
            assert torch.equal(decoded[0], together[i]), f"chain of {n}: row {i} differs from plain decoding"


def test_a_layer_as_one_kernel_call_has_the_python_layers_bits(
    bench: RowProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the blocks, a step whose segments all attend in the kernel runs each layer as one call of the kernel's
    module (``LlamaForward.kernel_step``): the same operations in the same order as the layer in Python."""
    if bench.form != "blocks":
        pytest.skip("only block products run a layer as one kernel call")
    forward = bench.runner._forward
    assert forward.kernel_layers is not None
    calls: list[int] = []
    real = llama_forward.layer_step
    monkeypatch.setattr(llama_forward, "layer_step", lambda *args: calls.append(1) or real(*args))
    for own, others in ((1, 0), (3, 5), (2, 25)):
        calls.clear()
        one_call = bench.step(own, others)
        assert len(calls) == len(forward.kernel_layers), "each layer ran as one kernel call"
        monkeypatch.setattr(forward, "kernel_layers", None)
        layer_by_layer = bench.step(own, others)
        monkeypatch.undo()
        monkeypatch.setattr(llama_forward, "layer_step", lambda *args: calls.append(1) or real(*args))
        assert torch.equal(one_call, layer_by_layer), f"{own} rows beside {others}: the two forms differ"
