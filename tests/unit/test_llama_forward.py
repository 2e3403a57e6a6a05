"""The engine's own forward against transformers' on tiny random models of each family it drives (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specserve.packed_linear import PackedLinear, available_packing
from specserve.tree_masks import ancestor_matrix
from target_service.kv_arena import KVArena
from target_service.llama_forward import UnsupportedModelError
from target_service.model_runner import ModelRunner
from target_service.ragged_attention import Segment, StepPlan

VOCAB = 96
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),  # biases on Q, K and V
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),  # per-head Q and K norms
}
CPU = torch.device("cpu")


def build(family: str) -> Any:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # random biases and norms, so a forward that skipped them would differ
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def reference_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def tree_step(
    runner: ModelRunner,
    prompts: list[list[int]],
    trees: list[tuple[list[int], list[int]]],
    arena: KVArena | None = None,
) -> torch.Tensor:
    """Prefill each prompt but its last token, then ONE step: each session's last token and its tree.

    Returns the fp32 logits of every row of that step (on the runner's device).
    """
    device = runner.device
    arena = arena or runner.new_arena(1024)
    regions = []
    for prompt in prompts:
        region = arena.allocate(len(prompt) + 16)
        assert region is not None
        cached = len(prompt) - 1
        plan = StepPlan(arena, [Segment.chunk(region, 0, slice(0, cached), device)])
        empty = torch.zeros(0, dtype=torch.long, device=device)
        ids = torch.tensor(prompt[:-1], device=device)
        runner.forward(plan, ids, torch.arange(cached, device=device), empty, empty)
        region.length = cached
        regions.append(region)
    plan = StepPlan(arena)
    ids: list[int] = []
    positions: list[int] = []
    for prompt, (tokens, parents), region in zip(prompts, trees, regions, strict=True):
        start, cached = len(ids), len(prompt) - 1
        n = 1 + len(tokens)
        depth = [0]
        for p in parents:
            depth.append(depth[p + 1] + 1)
        ids += [prompt[-1], *tokens]
        positions += [cached + d for d in depth]
        allowed = torch.ones(n, cached + n, dtype=torch.bool)
        allowed[:, cached:] = ancestor_matrix(torch.tensor([-1] + [p + 1 for p in parents]), max(depth) + 1)
        plan.segments.append(Segment(region, cached, slice(start, start + n), allowed.to(device)))
    rows = torch.arange(len(ids), device=device)
    ids_t, pos_t = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
    return runner.forward(plan, ids_t, pos_t, rows, rows[:0]).logits


PROMPTS = [[5, 9, 2, 77, 31, 8, 14], [60, 3, 3, 41], [11, 12]]
# (tokens, parents): a branching tree, a chain, nothing (plain decoding)
TREES = [([4, 19, 23, 7, 50], [-1, -1, 0, 0, 2]), ([1, 2, 3], [-1, 0, 1]), ([], [])]


def expected_rows(model: Any) -> torch.Tensor:
    """What transformers says for every row of ``tree_step``: each node scored after its own path."""
    rows = []
    for prompt, (tokens, parents) in zip(PROMPTS, TREES, strict=True):
        rows.append(reference_logits(model, prompt)[-1])
        for i in range(len(tokens)):
            path = []
            node = i
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            rows.append(reference_logits(model, prompt + path[::-1])[-1])
    return torch.stack(rows)


@pytest.mark.parametrize("compile", ["auto", "off"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ragged_tree_step_equals_transformers(family: str, compile: str) -> None:
    model = build(family)
    logits = tree_step(ModelRunner(model, compile), PROMPTS, TREES)
    torch.testing.assert_close(logits, expected_rows(model).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compile", ["auto", "off"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_step_equals_transformers(family: str, compile: str) -> None:
    """The static-shape step (CUDA graphs on a GPU, run uncaptured here): rows padded, one gathered window."""
    model = build(family)
    runner = ModelRunner(model, compile, static=True)
    arena = runner.new_arena(1024)
    arena.allocate(200)  # the sessions' regions do not start at slot 0: the window gathers them from elsewhere
    logits = tree_step(runner, PROMPTS, TREES, arena)
    torch.testing.assert_close(logits, expected_rows(model).float(), atol=1e-5, rtol=1e-5)


def test_fused_products_equal_the_separate_ones() -> None:
    model = build("qwen2")
    runner = ModelRunner(model, "auto")
    layer = model.model.layers[1]
    block = runner._forward.blocks[1]
    x = torch.randn(3, COMMON["hidden_size"])
    with torch.inference_mode():
        separate = torch.cat([layer.self_attn.q_proj(x), layer.self_attn.k_proj(x), layer.self_attn.v_proj(x)], -1)
        gate_up = torch.cat([layer.mlp.gate_proj(x), layer.mlp.up_proj(x)], -1)
        torch.testing.assert_close(block.qkv(x), separate, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(block.gate_up(x), gate_up, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("compile", "static"), [("auto", False), ("off", True)])
def test_padding_rows_touch_no_cache_slot_and_no_result(compile: str, static: bool) -> None:
    """A 3-row step runs as 4: the padding row is computed, but it writes into no region and is never read.

    The prepacked step gives it no segment; a static step (CUDA graphs) writes its key and value to the
    arena's scratch slot, past the capacity.
    """
    model = build("llama")
    runner = ModelRunner(model, compile, static=static)
    arena = runner.new_arena(64)
    assert arena.scratch_slot == (64 if static else None)
    for tensor in (*arena.keys, *arena.values):
        tensor[:, :64].fill_(7.0)
    region = arena.allocate(16)
    assert region is not None
    plan = StepPlan(arena, [Segment.chunk(region, 0, slice(0, 3), CPU)])
    rows = torch.arange(3)
    logits = runner.forward(plan, torch.tensor([5, 9, 2]), torch.arange(3), rows, rows[:0]).logits
    torch.testing.assert_close(logits, reference_logits(model, [5, 9, 2]), atol=1e-5, rtol=1e-5)
    for tensor in (*arena.keys, *arena.values):
        assert not torch.any(tensor[:, :3] == 7.0)
        assert torch.all(tensor[:, 3:64] == 7.0), "a padding row wrote into a region's slots"
        if static:
            assert torch.any(tensor[:, 64] != 0.0), "the padding row's key and value went to the scratch slot"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
def test_packed_linear_equals_f_linear_at_any_row_count(rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    x = torch.randn(rows, 32)
    packed = PackedLinear(weight, bias, available_packing(torch.float32, CPU), (2, 4, 8, 16, 32))
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_models_the_forward_cannot_reproduce_are_refused() -> None:
    config = LlamaConfig(**{**COMMON, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelRunner(LlamaForCausalLM(config).eval())
    mistral = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16)).eval()
    mistral.config.layer_types = ["sliding_attention"] * COMMON["num_hidden_layers"]
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelRunner(mistral)


def test_unknown_compile_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="compile"):
        ModelRunner(build("llama"), "reduce-overhead")


@pytest.mark.skipif(available_packing(torch.bfloat16, CPU) == "none", reason="this CPU has no bf16 packing")
def test_bf16_step_on_onednn_packs_matches_the_eager_step() -> None:
    """bf16 layers run on oneDNN's packed linear (one pack for every row count); the head stays fp32."""
    model = build("qwen2").to(torch.bfloat16)
    packed, eager = ModelRunner(model, "auto"), ModelRunner(model, "off")
    assert packed.packing == available_packing(torch.bfloat16, CPU)
    got, expected = tree_step(packed, PROMPTS, TREES), tree_step(eager, PROMPTS, TREES)
    assert got.dtype == torch.float32
    # bf16 products round differently in another kernel: close, not equal (greedy stays lossless against plain
    # decoding through the same engine, which uses the same kernel).
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=0)
    torch.testing.assert_close(got, expected_rows(model).float(), atol=1e-2, rtol=0)
