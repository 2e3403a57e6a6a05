"""The draft head's served layer (``DraftHead.step`` over a ``HeadCache``) computes what transformers' does."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, DraftHeadConfig, HeadOutput, in_serving_dtype, truncate_cache
from draft_service.head_layer import HeadCache
from specserve.block_weights import block_kernels
from specserve.tree_masks import additive_mask
from tests.conftest import tiny_llama

VOCAB = 48
TARGET = tiny_llama(vocab_size=VOCAB, seed=3, context=256)
HIDDEN = int(TARGET.config.hidden_size)


def trained_like_head(seed: int = 0, target: Any = TARGET) -> DraftHead:
    """A head with random weights everywhere, norms included (a fresh one has unit norms that hide a swap)."""
    config = DraftHeadConfig.for_target(target.config, 40, intermediate_size=96)
    embedding, lm_head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    head = DraftHead(config, embedding, lm_head, torch.arange(40))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 + (parameter == 1).float())
    return head.eval()


def rows(count: int, seed: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, hidden, generator=generator), torch.randint(VOCAB, (count,), generator=generator)


def both(
    head: DraftHead,
    ours: HeadCache,
    theirs: DynamicCache,
    features: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> tuple[HeadOutput, HeadOutput]:
    """The same rows through ``step`` and through ``forward`` (transformers' layer)."""
    mask = None if allowed is None else additive_mask(allowed, head.draft_lm_head.dtype)
    served = head.step(features.to(head.draft_lm_head.dtype), tokens, positions, ours, allowed)
    reference = head(
        features[None].to(head.draft_lm_head.dtype),
        tokens[None],
        position_ids=positions[None],
        past_key_values=theirs,
        attention_mask=mask,
    )
    return served, reference


@pytest.mark.parametrize("head_matmul", ["linear", "packed"])
def test_the_served_layer_equals_transformers_layer_through_a_drafting_session(head_matmul: str) -> None:
    """A context fed in chunks past the cache's first buffer, one speculative row, a masked tree level, crops."""
    head, _ = in_serving_dtype(trained_like_head(), "float32", head_matmul)  # as the drafter loads it
    with torch.inference_mode():  # as the proposer drafts
        drafting_session(head)


@pytest.mark.skipif(block_kernels() is None, reason="no block kernel here")
def test_on_q8_0_blocks_the_served_layer_runs_the_kernels_fused_ops_and_still_equals_transformers() -> None:
    """Heads of 32 values: the norms, rotary embeddings and attention (where a level sees its whole context) run
    in the block kernel's module, over the same Q8_0 weights transformers' layer then reads."""
    head, _ = in_serving_dtype(
        trained_like_head(target=tiny_llama(vocab_size=VOCAB, seed=3, hidden=128)), "float32", "blocks"
    )
    step = head._new_step()
    assert head.packing == "blocks" and step.fused
    with torch.inference_mode():
        # The kernel's fused norms, rotary and attention sum in their own order (8 lanes on AVX2, 16 on AVX512),
        # not transformers': 1.1e-5 apart at worst (features of order 1) on an AVX2-only EPYC, within 1e-5 on the
        # AVX512 CPUs this ran on before.
        drafting_session(head, hidden=128, tolerance=3e-5)


def drafting_session(head: DraftHead, hidden: int = HIDDEN, tolerance: float = 1e-5) -> None:
    ours, theirs = HeadCache(), DynamicCache()

    def check(
        features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> None:
        served, reference = both(head, ours, theirs, features, tokens, positions, allowed)
        torch.testing.assert_close(served.features, reference.features, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(served.logits, reference.logits, rtol=tolerance, atol=tolerance)
        assert ours.get_seq_length() == theirs.get_seq_length()

    for start, stop in ((0, 50), (50, 90), (90, 91)):  # 91 positions: the first 64-slot buffer grows
        features, tokens = rows(stop - start, start, hidden)
        check(features, tokens, torch.arange(start, stop))
    # A tree level of three nodes at depth 2 over two depth-1 entries: each sees the context, its parent, itself.
    features, tokens = rows(2, 7, hidden)
    check(features, tokens, torch.full((2,), 91))
    allowed = torch.zeros(3, 91 + 2 + 3, dtype=torch.bool)
    allowed[:, :91] = True
    allowed[0, 91] = allowed[1, 91] = allowed[2, 92] = True
    allowed[:, 93:] = torch.eye(3, dtype=torch.bool)
    features, tokens = rows(3, 8, hidden)
    check(features, tokens, torch.full((3,), 92), allowed)
    for cache in (ours, theirs):
        truncate_cache(cache, 91)  # the tree goes; the next rows overwrite its slots
    features, tokens = rows(5, 9, hidden)
    check(features, tokens, torch.arange(91, 96))


def test_last_logits_only_scores_the_last_row() -> None:
    head, _ = in_serving_dtype(trained_like_head(), "float32", "packed")
    features, tokens = rows(6, 1)
    with torch.inference_mode():
        every = head.step(features, tokens, torch.arange(6), HeadCache())
        last = head.step(features, tokens, torch.arange(6), HeadCache(), last_logits_only=True)
    assert last.logits.shape == (1, 1, 40) and every.logits.shape == (1, 6, 40)
    torch.testing.assert_close(last.logits[0, 0], every.logits[0, -1])


def test_the_served_layer_follows_new_weights_and_copies() -> None:
    """Its fused weights are copies: a head whose weights change, or a copy of a head, builds them again."""
    head, _ = in_serving_dtype(trained_like_head(0), "float32", "packed")
    features, tokens = rows(4, 2)
    with torch.inference_mode():
        before = head.step(features, tokens, torch.arange(4), HeadCache()).logits
    other = trained_like_head(1)
    layer: Any = head.body.layers[0]
    new: Any = other.body.layers[0]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.copy_(new.self_attn.q_proj.weight)
        layer.mlp.up_proj.weight.copy_(new.mlp.up_proj.weight)
    with torch.inference_mode():
        after = head.step(features, tokens, torch.arange(4), HeadCache())
        reference = head(features[None], tokens[None], position_ids=torch.arange(4)[None])
    assert not torch.allclose(after.logits, before)
    torch.testing.assert_close(after.logits, reference.logits, rtol=1e-5, atol=1e-5)
    copied = copy.deepcopy(head)
    with torch.inference_mode():
        torch.testing.assert_close(copied.step(features, tokens, torch.arange(4), HeadCache()).logits, after.logits)


def test_a_cache_crops_as_transformers_does_and_counts_its_buffers() -> None:
    cache = HeadCache()
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    keys = torch.ones(3, 70, 8)
    seen_keys, seen_values = cache.append(keys, 2 * keys)
    assert seen_keys.shape == (3, 70, 8) and torch.equal(seen_values, 2 * keys)
    assert cache.nbytes == 2 * 3 * 70 * 8 * 4  # sized to the first append when it is over 64 positions
    cache.crop(-10)
    assert cache.get_seq_length() == 60
    cache.crop(100)  # longer than held: nothing changes
    assert cache.get_seq_length() == 60
    seen_keys, _ = cache.append(torch.zeros(3, 20, 8), torch.zeros(3, 20, 8))
    assert seen_keys.shape == (3, 80, 8) and torch.equal(seen_keys[:, :60], keys[:, :60])
    assert not seen_keys[:, 60:].any()  # the cropped positions were written over
    assert cache.nbytes == 2 * 3 * 140 * 8 * 4  # grown by doubling
