"""The draft head and its training pipeline on a tiny random target."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, DraftHeadConfig, DraftHeadError, load_draft_head
from draft_service.training.distill_data import distil_batch
from draft_service.training.evaluate import accepted_length, chain_acceptance, top1_agreement, tree_acceptance
from draft_service.training.prompts import all_prompts, training_prompts
from draft_service.training.settings import TrainSettings
from draft_service.training.train import build_draft_vocab, train, unroll_mask, unrolled
from specserve.token_tree import TokenTree
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


def test_a_distilled_sequence_does_not_depend_on_its_batch() -> None:
    """Left padding with per-row positions and rows leaving at EOS: each row is what the target does alone."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 4, 4]]
    batched = distil_batch(TARGET, prompts, 12, EOS, PAD)
    for prompt, row in zip(prompts, batched, strict=True):
        alone = distil_batch(TARGET, [prompt], 12, EOS, PAD)[0]
        assert torch.equal(row["tokens"], alone["tokens"]) and torch.equal(row["argmax"], alone["argmax"])
        torch.testing.assert_close(row["features"].float(), alone["features"].float(), rtol=1e-2, atol=1e-2)


def test_distilled_sequences_hold_the_targets_greedy_answer_features_and_tokens() -> None:
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [11]]
    eos = frozenset({plain_greedy(TARGET, [5, 6, 7, 8, 9], 10)[4]})  # one row stops early, the others may not
    for prompt, row in zip(prompts, distil_batch(TARGET, prompts, 10, eos, PAD), strict=True):
        expected = plain_greedy(TARGET, prompt, 10)
        end = next((i for i, t in enumerate(expected) if t in eos), len(expected) - 1)
        answer = expected[: end + 1]
        # The prompt and the answer but its last token (whose feature is never computed) ...
        assert row["tokens"].tolist() == prompt + answer[:-1] and row["prompt_length"] == len(prompt)
        # ... the target's greedy token after each position: its answer from the prompt's end on ...
        assert row["argmax"].tolist()[len(prompt) - 1 :] == answer
        # ... and each feature is the final-norm output that the LM head turns into that token.
        ids = row["tokens"][None].long()
        out = TARGET(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(row["features"].float(), out.hidden_states[-1][0], rtol=1e-2, atol=1e-2)
        assert row["argmax"].tolist() == out.logits[0].argmax(-1).tolist()
    assert len(distil_batch(TARGET, prompts, 10, eos, PAD)[1]["tokens"]) <= 5 + 4  # stopped at its EOS


def test_sampled_answers_keep_the_targets_greedy_tokens_as_labels() -> None:
    """At a temperature the answer is sampled, reproducibly, while ``argmax`` stays the greedy token."""
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9]]

    def sampled(seed: int) -> list[dict[str, torch.Tensor | int]]:
        return distil_batch(TARGET, prompts, 16, frozenset(), PAD, 1.5, torch.Generator().manual_seed(seed))

    rows = sampled(0)
    for prompt, row in zip(prompts, rows, strict=True):
        tokens = row["tokens"]
        assert isinstance(tokens, torch.Tensor) and tokens[: len(prompt)].tolist() == prompt
        out = TARGET(input_ids=tokens[None].long(), output_hidden_states=True)
        assert row["argmax"].tolist() == out.logits[0].argmax(-1).tolist()
        torch.testing.assert_close(row["features"].float(), out.hidden_states[-1][0], rtol=1e-2, atol=1e-2)
    greedy = distil_batch(TARGET, prompts, 16, frozenset(), PAD)
    assert any(not torch.equal(s["tokens"], g["tokens"]) for s, g in zip(rows, greedy, strict=True))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rows, sampled(0), strict=True))
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rows, sampled(1), strict=True))
    with pytest.raises(ValueError, match="temperature must be 0 or more"):
        distil_batch(TARGET, prompts, 4, frozenset(), PAD, -1.0)


# Settings that train a head on the tiny target in seconds.
TINY_TRAINING = TrainSettings(
    draft_vocab_size=32, intermediate_size=96, window=32, batch_size=4, learning_rate=3e-3, ce_weight=1.0
)


def distilled(count: int, length: int = 40) -> list[dict[str, torch.Tensor | int]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB - 1, (6,), generator=generator).tolist() for _ in range(count)]
    return distil_batch(TARGET, prompts, length, frozenset(), PAD)


def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    data = distilled(24)
    settings = replace(TINY_TRAINING, epochs=10, max_minutes=5, checkpoint_every=5)
    first = replace(settings, epochs=1)
    untrained_head = new_head(build_draft_vocab(data, 32, VOCAB))
    untrained = chain_acceptance(untrained_head, data, depth=3, positions=60)
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
    assert top1_agreement(head, data) > 0.5 > top1_agreement(untrained_head, data)
    tree, untrained_tree = (
        tree_acceptance(head, data, positions=60),
        tree_acceptance(untrained_head, data, positions=60),
    )
    assert tree.acceptance_length > untrained_tree.acceptance_length
    # A tree holds the chain's path and more: the head alone accepts at least as much from a tree.
    assert tree.acceptance_length >= 1 + trained.accepted_at_depth[0]


def test_training_can_start_from_a_saved_head_its_weights_and_draft_vocabulary(tmp_path: Path) -> None:
    data, other = distilled(24), distilled(24, length=12)
    first, _ = train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "a", replace(TINY_TRAINING, epochs=6), False)
    first.save(tmp_path / "first.pt", target_fingerprint="fp")
    # A negligible learning rate: what the second run ends with is what it started from.
    still = replace(TINY_TRAINING, epochs=1, learning_rate=1e-12)
    fresh, _ = train(other, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "b", still, progress=False)
    again = replace(still, init_from=str(tmp_path / "first.pt"))
    resumed, _ = train(other, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "c", again, progress=False)
    assert torch.equal(resumed.draft_vocab, first.draft_vocab)
    assert not torch.equal(fresh.draft_vocab, first.draft_vocab)  # the other data would have picked another
    assert top1_agreement(resumed, data) == pytest.approx(top1_agreement(first, data), abs=0.02)
    assert top1_agreement(resumed, data) > top1_agreement(fresh, data) + 0.2


def test_train_draft_refuses_a_starting_head_for_another_target_or_shape(tmp_path: Path) -> None:
    from draft_service.training.__main__ import check_initial_head, parse_args

    new_head().save(tmp_path / "head.pt", target_fingerprint="fp")
    with pytest.raises(DraftHeadError, match="trained for the vocabulary fp"):
        check_initial_head(parse_args(["--init-from", str(tmp_path / "head.pt")]), "other")
    with pytest.raises(DraftHeadError, match="pass --intermediate-size 96"):
        check_initial_head(parse_args(["--init-from", str(tmp_path / "head.pt")]), "fp")
    args = parse_args(["--init-from", str(tmp_path / "head.pt"), "--intermediate-size", "96", "--draft-vocab", "9"])
    check_initial_head(args, "fp")
    assert args.draft_vocab == 16  # the file's, whatever was asked


def test_training_time_test_trains_every_draft_step(tmp_path: Path) -> None:
    data = distilled(24)
    # In bf16 autocast too, as `make train-draft` trains where the CPU runs bf16 natively.
    settings = replace(TINY_TRAINING, epochs=6, unroll_steps=3, autocast_bf16=True)
    head, report = train(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path, settings, progress=False)
    assert len(report.final_accuracy_by_step) == 3 and all(a > 0.3 for a in report.final_accuracy_by_step)
    untrained = chain_acceptance(new_head(build_draft_vocab(data, 32, VOCAB)), data, depth=3, positions=60)
    assert chain_acceptance(head, data, depth=3, positions=60).accepted_at_depth[1] > untrained.accepted_at_depth[1]


def test_accepted_length_follows_the_matching_path() -> None:
    # root -> 5 -> {6 -> 8, 7 -> 9}
    tree = TokenTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 2))
    assert accepted_length(tree, [5, 7, 9, 1]) == 3
    assert accepted_length(tree, [5, 6, 9]) == 2
    assert accepted_length(tree, [4]) == 0
    assert accepted_length(TokenTree(), [5]) == 0


@torch.inference_mode()
def test_unrolled_training_steps_are_the_heads_chained_drafts() -> None:
    """Training-time test: step k at position s is the k-th draft serving chains from the context up to s - k + 1."""
    head = new_head().eval()
    n = 9
    features, next_tokens = torch.randn(1, n, 64), torch.randint(VOCAB, (1, n))
    outputs = unrolled(head, features, next_tokens, torch.ones(1, n, dtype=torch.long), steps=3)
    for step, out in enumerate(outputs, start=1):
        for s in range(step - 1, n):
            cache = DynamicCache()
            context = s - step + 2
            draft = head(features[:, :context], next_tokens[:, :context], past_key_values=cache).features[:, -1:]
            for position in range(context, s + 1):
                draft = head(
                    draft,
                    next_tokens[:, position : position + 1],
                    position_ids=torch.tensor([[position]]),
                    past_key_values=cache,
                ).features
            torch.testing.assert_close(out.features[:, s], draft[:, -1], rtol=1e-4, atol=1e-4)


def test_unroll_mask_sees_the_true_context_the_chain_and_itself() -> None:
    allowed = unroll_mask(4, 3).int().tolist()
    # Keys: true entries 0-3 | step-2 entries 0-3 | step-3 entries 0-3.
    assert allowed[2] == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    assert allowed[3] == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ce-weight", "-0.5"], "--ce-weight must be 0 or more"),
        (["--unroll-steps", "0"], "--unroll-steps must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--learning-rate", "0"], "--learning-rate must be more than 0"),
        (["--skip-prompts", "-1"], "--skip-prompts must be 0 or more"),
        (["--temperature", "-0.1"], "--temperature must be 0"),
    ],
)
def test_train_draft_refuses_settings_that_cannot_train(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from draft_service.training.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--ce-weight", "0"]).ce_weight == 0.0


def test_skipped_prompts_are_new_data_evaluated_on_the_same_held_out_prompts() -> None:
    from draft_service.training.__main__ import split_prompts

    mix = list(range(100))
    first_held_out, first = split_prompts(mix, 10, 0, 40)
    later_held_out, later = split_prompts(mix, 10, 40, 50)
    assert first_held_out == later_held_out == list(range(10))
    assert first == list(range(10, 50)) and later == list(range(50, 100))
    with pytest.raises(SystemExit, match="only 100 prompts are available, 101 were asked for"):
        split_prompts(mix, 10, 41, 50)


def test_the_model_card_says_whether_the_answers_were_greedy_or_sampled() -> None:
    import json

    from draft_service.training.__main__ import model_card

    metrics = json.loads(Path("draft_service/weights/smollm2-draft-head.json").read_text())
    config = DraftHeadConfig(576, 1024, 9, 3, 1e5, 1e-5, 8192, 8192)
    out = Path("head.pt")
    greedy = model_card({**metrics, "data": {**metrics["data"], "temperature": 0.0}}, config, out)
    assert "the target's own greedy answers (at most" in greedy
    sampled = model_card({**metrics, "data": {**metrics["data"], "temperature": 0.7}}, config, out)
    assert "answers sampled at temperature 0.7 among its 64 likeliest tokens (labelled with" in sampled
    assert "greedy answers (at most" not in sampled


def test_the_held_out_prompts_are_named_by_a_digest_that_the_model_card_shows() -> None:
    import json

    from draft_service.training.__main__ import model_card, prompts_digest

    held_out = [[1, 2, 3], [4, 5]]
    assert prompts_digest(held_out) == prompts_digest([list(ids) for ids in held_out])
    assert prompts_digest(held_out) != prompts_digest([[1, 2, 3], [4, 6]])
    assert prompts_digest(held_out) != prompts_digest(held_out[::-1])
    metrics = json.loads(Path("draft_service/weights/smollm2-draft-head.json").read_text())
    config = DraftHeadConfig(576, 1024, 9, 3, 1e5, 1e-5, 8192, 8192)
    digest = prompts_digest(held_out)
    card = model_card({**metrics, "data": {**metrics["data"], "held_out_digest": digest}}, config, Path("head.pt"))
    assert f"held out for evaluation (prompt digest `{digest}`" in card
    assert "prompt digest" not in model_card(metrics, config, Path("head.pt"))  # the shipped v6 recorded none
