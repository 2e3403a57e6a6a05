"""fp32 weights read as llama.cpp blocks: found exactly, or not at all, and multiplied as the fp32 weights.

A GGUF model de-quantized to fp32 holds, per block of 32 inputs, fp16 parameters and small integers. The
block kernel reads those (a sixth to a quarter of fp32's bytes), rebuilds every weight bit for bit, and
multiplies in fp32; a row's bits must not depend on how many rows share the call (batch invariance, which
greedy identity through trees rests on).
"""

from __future__ import annotations

import pytest
import torch

from specserve.block_weights import (
    BlockWeight,
    attend_rows,
    block_kernels,
    find_blocks,
    q4_1_blocks,
    q8_0_blocks,
    quantize_q4_1,
    quantize_q8_0,
    serial_kernels,
)
from specserve.packed_linear import ONEDNN_ROWS, PackedLinear, fp32_head, invariant_rows, weight_blocks
from specserve.token_tree import TokenTree
from target_service.kv_arena import KVArena
from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan, attend_segments, causal_mask
from target_service.step_inputs import tree_mask
from tests.conftest import gguf_like, q4_1_with_large_minimums, tiny_llama

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="the block kernel does not build here")


def weight(out: int = 37, in_: int = 96, seed: int = 0, std: float = 0.05) -> torch.Tensor:
    return torch.randn(out, in_, generator=torch.Generator().manual_seed(seed)) * std


def one_ulp_off(w: torch.Tensor, index: tuple[int, int]) -> torch.Tensor:
    moved = w.clone()
    moved[index] = torch.nextafter(moved[index], torch.tensor(float("inf")))
    return moved


@pytest.mark.parametrize(
    ("quantize", "find", "block_format"), [(quantize_q4_1, q4_1_blocks, "Q4_1"), (quantize_q8_0, q8_0_blocks, "Q8_0")]
)
def test_blocks_are_found_exactly_or_not_at_all(quantize, find, block_format) -> None:  # type: ignore[no-untyped-def]
    w = quantize(weight())
    assert find(w) is not None
    found = find_blocks(w)
    assert found is not None and found.block_format == block_format
    assert find(one_ulp_off(w, (3, 40))) is None, "one weight one ulp away is not a block's value"
    assert find(weight()) is None, "fp32 weights of a trained model are not blocks"
    assert find(w.bfloat16()) is None and find(w[:, :90]) is None, "fp32 only, inputs a multiple of 32"
    assert find_blocks(torch.zeros(4, 64)) is not None, "a block of zeros is a block (d = 0)"


def product_of(w: torch.Tensor) -> BlockWeight:
    found = find_blocks(w)
    assert found is not None
    return BlockWeight(found)


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0])
def test_the_kernel_rebuilds_every_weight_bit_for_bit(quantize) -> None:  # type: ignore[no-untyped-def]
    w = quantize(weight(std=3.0))
    identity = torch.eye(w.shape[1])  # each row picks one input: the product is the weights themselves
    assert torch.equal(product_of(w)(identity).view(torch.int32), w.T.contiguous().view(torch.int32))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 40])
@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0])
def test_the_block_product_is_the_fp32_product(rows: int, quantize) -> None:  # type: ignore[no-untyped-def]
    w = quantize(weight())
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.double().T
    fp32_error = (torch.nn.functional.linear(x, w).double() - exact).abs().max()
    y = product_of(w)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, w.shape[0])
    # Same products, other order of sums: within a few times the fp32 kernel's own rounding of the exact sum
    assert (y.double() - exact).abs().max() <= 4 * fp32_error + 1e-7


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0])
def test_a_row_gets_the_same_bits_at_every_row_count(quantize) -> None:  # type: ignore[no-untyped-def]
    w = quantize(weight(out=69, in_=96))  # 69 outputs: whole tiles, a partial one (padded); 3 blocks
    product = product_of(w)
    x = torch.randn(41, w.shape[1], generator=torch.Generator().manual_seed(7))
    alone = torch.cat([product(x[i : i + 1]) for i in range(41)])
    for rows in range(1, 42):
        together = product(x[:rows])
        assert torch.equal(together, alone[:rows]), f"{rows} rows together differ from each row alone"


def test_the_packed_linear_runs_blocks_to_its_largest_bucket_and_onednn_beyond() -> None:
    w, bias = quantize_q4_1(weight(out=64, in_=64)), torch.randn(64)
    buckets = invariant_rows("blocks", torch.float32, {(64, 64)})
    assert buckets == ONEDNN_ROWS, "the block kernel computes a row alike at every row count"
    original = w.clone()
    product = PackedLinear(w, bias, "blocks", buckets)
    assert product.block_format == "Q4_1" and product.runs_wide_rows_on_onednn
    assert torch.equal(w, original), "packing leaves the model's weights as they were"
    x = torch.randn(40, 64)
    assert torch.equal(product(x[:32]), product_of(w)(x[:32]) + bias)
    onednn = PackedLinear(w, bias, "onednn", ONEDNN_ROWS)
    assert torch.equal(product(x), onednn(x)), "past the largest bucket the step runs oneDNN's fp32 product"
    with pytest.raises(ValueError, match="blocks"):
        PackedLinear(weight(), None, "blocks", buckets)


def test_a_gguf_like_model_runs_on_blocks_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    model = gguf_like(tiny_llama(vocab_size=64, seed=3))
    runner = ModelRunner(model, "auto")
    assert runner.packing == "blocks" and runner.head_packing == "blocks"
    assert "GGUF-block (Q4_1) float32 products at rows 1-32" in runner.describe()
    assert "fp32 head GGUF-block Q8_0" in runner.describe()
    assert ModelRunner(tiny_llama(vocab_size=64, seed=3), "auto").packing != "blocks", "trained-like weights"
    assert ModelRunner(model, "off").packing == "none"
    assert weight_blocks([w.detach().bfloat16() for w in model.parameters() if w.dim() == 2]) is None
    assert fp32_head(model.lm_head.weight.detach()).packing == "blocks"


def test_the_engine_step_on_blocks_matches_transformers() -> None:
    """The whole step over block weights equals transformers' fp32 forward of the same weights (to rounding)."""
    from bench.step_invariance import RowProbe

    model = gguf_like(tiny_llama(vocab_size=64, seed=4))
    probe = RowProbe(ModelRunner(model, "auto"), vocab=64)
    reference = RowProbe(ModelRunner(model, "off"), vocab=64)
    torch.testing.assert_close(probe.step(3, 0), reference.step(3, 0), atol=1e-5, rtol=1e-5)


def test_the_packaged_gguf_model_is_blocks_and_a_hugging_face_directory_is_not(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from specserve.block_weights import gguf_block_layers
    from specserve.model_loading import ModelSource, resolve_model

    assert gguf_block_layers(resolve_model("smollm2")), "SmolLM2's GGUF: Q4_1 layers, a Q8_0 embedding"
    assert not gguf_block_layers(ModelSource(tmp_path))


def test_the_fused_norm_and_rotary_compute_the_eager_forms() -> None:
    from specserve.block_weights import fused_ops_fit, rms_norm_rows, rotary_rows
    from specserve.llama_ops import apply_rotary, rms_norm, rotary_tables

    assert fused_ops_fit(64, 64) and not fused_ops_fit(64, 80), "whole vector registers only"
    generator = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 64, generator=generator), torch.randn(64, generator=generator)
    torch.testing.assert_close(rms_norm_rows(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    alone = torch.cat([rms_norm_rows(x[i : i + 1], w, 1e-5) for i in range(9)])
    assert torch.equal(rms_norm_rows(x, w, 1e-5), alone), "each row alike whatever the row count"
    qkv = torch.randn(9, 6 * 64, generator=generator)
    qk = qkv[:, : 5 * 64].view(9, 5, 64)  # a strided view, as the forward takes it from the fused product
    cos, sin = rotary_tables(torch.arange(9), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), 1.0, torch.float32)
    assert torch.equal(rotary_rows(qk, cos, sin), apply_rotary(qk, cos, sin)), "the same bits as eager"


def test_q4_1_blocks_whose_minimum_dwarfs_their_scale_are_found_too() -> None:
    """d * 15 + m rounds once; where m is far larger than d the span over 15 can round to d's fp16 neighbour."""
    from specserve.block_weights import _q4_1_integers

    out, blocks = 64, 8
    w, low = q4_1_with_large_minimums(out, blocks)
    first_guess = ((w.reshape(out, blocks, 32).amax(-1, keepdim=True) - low) / 15).half().float()
    _, rebuilt = _q4_1_integers(w.reshape(out, blocks, 32), low, first_guess)
    assert not bool(rebuilt.all()), "the case under test: some first guesses do not rebuild their block"
    found = q4_1_blocks(w)  # (a neighbour that rebuilds the block serves as well as the d it was written with)
    assert found is not None
    identity = torch.eye(w.shape[1])
    assert torch.equal(BlockWeight(found)(identity).view(torch.int32), w.T.contiguous().view(torch.int32))


HEADS, KV_HEADS, DIM = 6, 2, 64
TREE_PARENTS = (-1, -1, 0, 0, 2, 1)  # six draft nodes under the pending token: node 4's path is 0, 2, 4
TREE_CACHED = 17


def _tree_step(kernel: bool, keep: set[int], contexts: list[int]) -> tuple[torch.Tensor, KVArena, StepPlan, dict]:
    """One-row segments over ``contexts``, a verify's tree after them, then a prefill chunk over nothing cached;
    only the segments in ``keep`` attend. Returns the output, the arena, the plan and the step's inputs."""
    g = torch.Generator().manual_seed(3)
    arena = KVArena(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, capacity_tokens=4096, dtype=torch.float32)
    segments = []
    for row, cached in enumerate(contexts):
        region = arena.allocate(cached + 8)
        assert region is not None
        past = torch.randn(KV_HEADS, cached, DIM, generator=g)
        arena.write(0, region, 0, past, -past)
        segments.append(Segment(region, cached, slice(row, row + 1), causal_mask(cached, 1, torch.device("cpu"))))
    tree_rows = len(TREE_PARENTS) + 1
    tree = arena.allocate(64)
    assert tree is not None
    past_k, past_v = (
        torch.randn(KV_HEADS, TREE_CACHED, DIM, generator=g),
        torch.randn(KV_HEADS, TREE_CACHED, DIM, generator=g),
    )
    arena.write(0, tree, 0, past_k, past_v)
    depths = torch.tensor([0, *TokenTree(tuple(range(len(TREE_PARENTS))), TREE_PARENTS).depths()])
    first = len(contexts)
    segments.append(
        Segment(tree, TREE_CACHED, slice(first, first + tree_rows), tree_mask(TREE_PARENTS, depths, TREE_CACHED))
    )
    chunk = arena.allocate(64)
    assert chunk is not None
    segments.append(Segment.chunk(chunk, 0, slice(first + tree_rows, first + tree_rows + 5), torch.device("cpu")))
    rows = first + tree_rows + 5
    q = torch.randn(rows, HEADS, DIM, generator=g)
    k, v = torch.randn(rows, KV_HEADS, DIM, generator=g), torch.randn(rows, KV_HEADS, DIM, generator=g)
    plan = StepPlan(arena, [s for i, s in enumerate(segments) if i in keep])
    out = attend_segments(plan, 0, q, k, v, DIM**-0.5, attend_rows if kernel else None)
    return out, arena, plan, {"q": q, "k": k, "v": v, "past": (past_k, past_v), "first": first}


def test_verify_segments_attend_in_one_call_as_sdpa_does_per_segment() -> None:
    contexts = [0, 1, 15, 16, 17, 300]
    every = set(range(len(contexts) + 2))
    fused, fused_arena, plan, _ = _tree_step(True, every, contexts)
    sdpa, sdpa_arena, _, _ = _tree_step(False, every, contexts)
    table, allowed, others = plan.kernel_rows()
    assert table[:, 1].tolist() == [1] * len(contexts) + [len(TREE_PARENTS) + 1], "one-row segments and the tree"
    assert [s.causal for s in others] == [True], "the prefill chunk stays with SDPA"
    assert allowed.numel() == len(contexts) + (len(TREE_PARENTS) + 1) ** 2
    torch.testing.assert_close(fused, sdpa, atol=1e-6, rtol=1e-5)
    lengths = [cached + 1 for cached in contexts] + [TREE_CACHED + len(TREE_PARENTS) + 1, 5]  # held after the step
    for region_f, region_s, length in zip(fused_arena._regions, sdpa_arena._regions, lengths, strict=True):
        pairs = zip(fused_arena.read(0, region_f, length), sdpa_arena.read(0, region_s, length), strict=True)
        for got, expected in pairs:
            assert torch.equal(got, expected), "the new keys and values written where SDPA's path writes them"
    assert torch.equal(fused[-5:], sdpa[-5:]), "the prefill chunk still runs SDPA"
    for segment in range(len(contexts) + 1):
        alone, _, alone_plan, _ = _tree_step(True, {segment}, contexts)
        rows = alone_plan.segments[0].rows
        assert torch.equal(alone[rows], fused[rows]), "a row's attention does not depend on the rows beside it"


def test_a_draft_nodes_attention_has_the_bits_plain_decoding_of_its_path_has() -> None:
    """Node 4 (path 0, 2, 4 under the pending token) attends as the last of four one-row decoding steps would."""
    tree, _, _, inputs = _tree_step(True, {0}, [])
    past_k, past_v = inputs["past"]
    path = [0, 1, 3, 5]  # the tree segment's rows: the pending token, then nodes 0, 2 and 4
    arena = KVArena(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, capacity_tokens=256, dtype=torch.float32)
    region = arena.allocate(64)
    assert region is not None
    arena.write(0, region, 0, past_k, past_v)
    for depth, row in enumerate(path):
        cached = TREE_CACHED + depth
        plan = StepPlan(arena, [Segment(region, cached, slice(row, row + 1))])
        decoded = attend_segments(plan, 0, inputs["q"], inputs["k"], inputs["v"], DIM**-0.5, attend_rows)
        assert torch.equal(decoded[row], tree[row]), f"depth {depth}: the tree row and the decoded row differ"


def test_where_the_kernel_cannot_build_or_is_turned_off_the_products_run_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = gguf_like(tiny_llama(vocab_size=64, seed=3))
    try:
        block_kernels.cache_clear()
        monkeypatch.setenv("SPECSERVE_CACHE_DIR", "/proc/no-such-cache")  # nowhere to build: logged, not raised
        assert block_kernels() is None
        assert ModelRunner(model, "auto").packing not in ("blocks", "none")
        block_kernels.cache_clear()
        monkeypatch.delenv("SPECSERVE_CACHE_DIR")
        monkeypatch.setenv("SPECSERVE_BLOCK_GEMM", "off")
        assert block_kernels() is None and weight_blocks([quantize_q4_1(weight(out=32, in_=64))]) is None
    finally:
        monkeypatch.undo()
        block_kernels.cache_clear()
    assert block_kernels() is not None


def test_serial_kernels_run_the_same_loops_on_this_thread_and_restore_the_setting() -> None:
    """A draft head's thread runs the kernel without an OpenMP team of its own; the bits are the team's."""
    kernels = block_kernels()
    assert kernels is not None
    found = find_blocks(quantize_q4_1(weight(out=96, in_=128)))
    assert found is not None
    weight_ = BlockWeight(found)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    on_team = weight_(x)
    with serial_kernels():
        assert kernels.set_serial(True) is True  # inside: serial (the call returns the setting before it)
        alone = weight_(x)
    assert kernels.set_serial(False) is False, "the setting before the block came back"
    assert torch.equal(alone, on_team)
