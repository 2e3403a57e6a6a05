"""The draft head and its training pipeline on a tiny random target."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service.draft_head import DraftHead, DraftHeadConfig, DraftHeadError, load_draft_head
from draft_service.training.distill_data import features_of, greedy_responses
from draft_service.training.evaluate import chain_acceptance
from draft_service.training.prompts import all_prompts, training_prompts
from draft_service.training.train import TrainSettings, build_draft_vocab, train
from tests.conftest import plain_greedy, tiny_llama

VOCAB = 48
TARGET = tiny_llama(vocab_size=VOCAB, seed=3, context=256)
EMBEDDING = TARGET.get_input_embeddings().weight.detach()
LM_HEAD = TARGET.get_output_embeddings().weight.detach()
EOS = frozenset({VOCAB - 1})
PAD = 0


def new_head(draft_vocab: torch.Tensor | None = None) -> DraftHead:
    ids = torch.arange(16) * 2 if draft_vocab is None else draft_vocab
    config = DraftHeadConfig.for_target(TARGET.config, ids.numel(), intermediate_size=96)
    return DraftHead(config, EMBEDDING, LM_HEAD, ids)


def test_forward_shapes_and_draft_vocabulary_rows() -> None:
    head = new_head()
    out = head(torch.randn(2, 5, 64), torch.randint(VOCAB, (2, 5)))
    assert out.features.shape == (2, 5, 64) and out.logits.shape == (2, 5, 16)
    torch.testing.assert_close(out.logits, out.features @ LM_HEAD[::2][:16].T)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    head = new_head().eval()
    path = tmp_path / "head.pt"
    head.save(path, target_fingerprint="fp", metadata={"steps": 3})
    loaded, metadata = load_draft_head(path, target_fingerprint="fp", embedding=EMBEDDING, lm_head=LM_HEAD)
    assert metadata == {"steps": 3}
    inputs = (torch.randn(1, 4, 64), torch.randint(VOCAB, (1, 4)))
    # Stored in bfloat16: close, not equal.
    torch.testing.assert_close(loaded(*inputs).logits, head(*inputs).logits, rtol=0.05, atol=0.05)


def test_unusable_weight_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "head.pt"
    with pytest.raises(DraftHeadError, match=r"no draft head weights .* run `make train-draft`"):
        load_draft_head(path, target_fingerprint="fp", embedding=EMBEDDING, lm_head=LM_HEAD)
    path.write_bytes(b"not a torch file")
    with pytest.raises(DraftHeadError, match="not a readable draft head file"):
        load_draft_head(path, target_fingerprint="fp", embedding=EMBEDDING, lm_head=LM_HEAD)
    new_head().save(path, target_fingerprint="fp")
    with pytest.raises(DraftHeadError, match="trained for the target vocabulary fp"):
        load_draft_head(path, target_fingerprint="other", embedding=EMBEDDING, lm_head=LM_HEAD)
    wider = torch.randn(VOCAB, 128)
    with pytest.raises(DraftHeadError, match="hidden size is 128"):
        load_draft_head(path, target_fingerprint="fp", embedding=wider, lm_head=wider)


def test_batched_features_equal_each_sequence_alone() -> None:
    """Left padding with per-row positions: a sequence's features do not depend on its batch."""
    sequences = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 4, 4]]
    batched = features_of(TARGET, sequences, PAD)
    for ids, (features, argmax) in zip(sequences, batched, strict=True):
        alone, alone_argmax = features_of(TARGET, [ids], PAD)[0]
        torch.testing.assert_close(features.float(), alone.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(argmax, alone_argmax)


def test_batched_greedy_responses_are_the_targets_greedy_answers() -> None:
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9]]
    responses = greedy_responses(TARGET, prompts, 10, EOS, PAD)
    for prompt, response in zip(prompts, responses, strict=True):
        expected = plain_greedy(TARGET, prompt, 10)
        end = next((i for i, t in enumerate(expected) if t in EOS), None)
        assert response == (expected if end is None else expected[: end + 1])


def distilled(count: int, length: int = 40) -> list[dict[str, torch.Tensor | int]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB - 1, (6,), generator=generator).tolist() for _ in range(count)]
    responses = greedy_responses(TARGET, prompts, length, frozenset(), PAD)
    full = [p + r for p, r in zip(prompts, responses, strict=True)]
    return [
        {"tokens": torch.tensor(ids, dtype=torch.int32), "features": f, "argmax": a, "prompt_length": 6}
        for ids, (f, a) in zip(full, features_of(TARGET, full, PAD), strict=True)
    ]


def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    data = distilled(24)
    settings = TrainSettings(
        draft_vocab_size=32,
        intermediate_size=96,
        window=32,
        batch_size=4,
        learning_rate=3e-3,
        ce_weight=1.0,
        epochs=10,
        max_minutes=5,
        checkpoint_every=5,
    )
    first = replace(settings, epochs=1)
    untrained = chain_acceptance(new_head(build_draft_vocab(data, 32, VOCAB)), data, depth=3, positions=60)
    head, report = train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "a", first, progress=False)
    assert report.steps > 0 and report.resumed_from_step == 0
    # A second run with the same checkpoint directory and settings continues, it does not restart.
    with pytest.raises(ValueError, match="other settings"):
        train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "a", settings, progress=False)
    head, report = train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "b", settings, progress=False)
    _, resumed = train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "b", settings, progress=False)
    assert resumed.resumed_from_step == report.steps == resumed.steps
    trained = chain_acceptance(head, data, depth=3, positions=60)
    assert trained.accepted_at_depth[0] > 0.5 > untrained.accepted_at_depth[0]
    assert trained.mean_accepted > untrained.mean_accepted


def test_draft_vocabulary_is_the_most_predicted_tokens() -> None:
    data = [{"argmax": torch.tensor([5, 5, 5, 7, 7, 2], dtype=torch.int32)}]
    assert build_draft_vocab(data, 2, VOCAB).tolist() == [5, 7]
    assert build_draft_vocab(data, 4, VOCAB).tolist() == [0, 2, 5, 7]  # filled up to a fixed shape


def test_training_prompts_exclude_the_benchmark() -> None:
    prompts = all_prompts()
    assert len(set(prompts)) == len(prompts) > 1000
    banned = prompts[:3]
    chosen = training_prompts(10, excluded=[p.upper() for p in banned])
    assert not set(chosen) & set(banned) and len(chosen) == 10
    with pytest.raises(ValueError, match="only"):
        training_prompts(10**6, excluded=[])


def test_the_drafter_refuses_to_start_without_its_head_weights(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pt"
    result = subprocess.run(
        [sys.executable, "-m", "draft_service", "--sources", "draft_model", "--draft-head-path", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"no draft head weights at {missing}: run `make train-draft`" in result.stderr
