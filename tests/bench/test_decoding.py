"""bench.decoding on a tiny random model: the plain loop's fp32 head, in fp32 and in bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from bench.decoding import Fp32Head, hf_generate, plain_decode, top2_gap

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NO_EOS: frozenset[int] = frozenset({63})


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def test_in_fp32_the_plain_loop_is_transformers_greedy_generate() -> None:
    model = tiny_llama()
    ours = plain_decode(model, PROMPT, 12, NO_EOS)
    theirs = hf_generate(model, PROMPT, 12, NO_EOS)
    assert ours.tokens == theirs.tokens and ours.forwards == 12


@torch.inference_mode()
def test_the_head_runs_in_fp32_on_a_bf16_model() -> None:
    model = tiny_llama(torch.bfloat16)
    head = Fp32Head(model)
    assert head.dtype == "bfloat16"
    logits = head.last_logits(PROMPT)
    assert logits.dtype == torch.float32 and logits.shape == (1, 64)
    # The hidden state entering the final norm, normed and projected in fp32.
    entering = _pre_norm(model, PROMPT)
    expected = F.linear(model.model.norm(entering.float()), model.lm_head.weight.float())
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    top = torch.topk(logits[0], 2).values
    assert top2_gap(model, PROMPT[:-2], PROMPT[-2:], head) == float(top[0] - top[1])


def _pre_norm(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _, args: captured.append(args[0][0, -1:]))
    try:
        model.model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return captured[0]
