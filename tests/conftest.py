"""Shared test helpers: tiny random models and plain (greedy or seeded sampled) decoding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coordinator.rounds import Generation, GenerationStats, TextChunk
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.sampling import SamplingParams

T = TypeVar("T")


def tiny_llama(
    vocab_size: int = 64, seed: int = 0, layers: int = 2, context: int = 512, hidden: int = 64
) -> LlamaForCausalLM:
    """A randomly initialised Llama small enough for unit tests (a few ms per forward): 4 heads of hidden / 4."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def plain_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference decoding: one token per forward with a KV cache, argmax each step."""
    return plain_decode(model, prompt, max_new_tokens, SamplingParams())


@torch.inference_mode()
def plain_decode(
    model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, sampling: SamplingParams
) -> list[int]:
    """Reference decoding: one token per forward with a KV cache; argmax, or the seeded keyed sample of p."""
    from transformers import DynamicCache

    assert sampling.greedy or sampling.seed is not None, "a reference sample needs a seed"
    noise = PositionNoise(sampling.seed or 0, first_position=len(prompt))
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    generated: list[int] = []
    for step in range(max_new_tokens):
        logits = out.logits[0, -1:]
        token = int(logits.argmax()) if sampling.greedy else noise.sample(target_probs(logits, sampling)[0], step)
        generated.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    return generated


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The packaged target's real tokenizer (converted once into the model cache)."""
    from specserve.model_loading import default_cache_root, load_tokenizer, materialize, resolve_model

    return load_tokenizer(materialize(resolve_model("smollm2"), default_cache_root()))


class CharTokenizer:
    """Unit-test stand-in for a tokenizer: token i decodes to one letter; no special tokens."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


async def stream_to_end(generation: Generation) -> tuple[list[int], str, GenerationStats]:
    """The round loop run to its end: the streamed tokens, the streamed text, the final stats."""
    tokens: list[int] = []
    text = ""
    async for event in generation.stream():
        if isinstance(event, TextChunk):
            tokens += event.token_ids
            text += event.text
        else:
            return tokens, text, event
    raise AssertionError("no stats at the end of the stream")


def run_generation(generation: Generation) -> tuple[list[int], str, GenerationStats]:
    """Run the round loop to its end: the streamed tokens, the streamed text, the final stats."""
    return asyncio.run(stream_to_end(generation))


def run_together(generations: list[Generation]) -> list[tuple[list[int], str, GenerationStats]]:
    """Run several round loops at once, on one event loop, each to its end (``stream_to_end``)."""

    async def together() -> list[tuple[list[int], str, GenerationStats]]:
        return list(await asyncio.gather(*(stream_to_end(g) for g in generations)))

    return asyncio.run(together())


def gguf_like(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` with weights as a GGUF file's de-quantized ones: layers Q4_1 blocks, the LM head Q8_0 blocks."""
    from specserve.block_weights import quantize_q4_1, quantize_q8_0

    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj):
                module.weight.copy_(quantize_q4_1(module.weight))
            mlp.down_proj.weight.copy_(quantize_q4_1(mlp.down_proj.weight))
        model.lm_head.weight.copy_(quantize_q8_0(model.lm_head.weight))
    return model


def q4_1_with_large_minimums(out: int = 64, blocks: int = 8, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [out, blocks * 32] of llama.cpp Q4_1 blocks whose minimums dwarf their scales (d * 15 + m
    can round to d's fp16 neighbour, so finding them takes the neighbour step), and those minimums."""
    generator = torch.Generator().manual_seed(seed)
    low = (256 + 768 * torch.rand(out, blocks, 1, generator=generator)).half().float()
    scale = (2e-3 + 6e-3 * torch.rand(out, blocks, 1, generator=generator)).half().float()
    q = torch.randint(0, 16, (out, blocks, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # as llama.cpp writes a block: its smallest value at 0, its largest at 15
    return (scale * q + low).reshape(out, blocks * 32), low


def wait_until(check: Callable[[], T], within_s: float, what: str, every_s: float = 0.2) -> T:
    """``check()``'s first truthy answer, asked every ``every_s`` until ``within_s`` have passed (then it fails,
    saying ``what`` never happened).

    For what a test can only observe from outside the processes it runs (a restarted drafter taken back by the
    coordinator's probe, a reload, sessions freed): ``within_s`` only guards against a hang, and a fast machine
    moves on at its first chance. Where the service pushes the change (health's Watch), wait on that instead.
    """
    deadline = time.monotonic() + within_s
    while not (answer := check()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {within_s:.0f} s (last answer {answer!r})")
        time.sleep(every_s)
    return answer
