"""``make train-draft --format eagle3``: distilling the target's layers, training the served module, and the
directory it writes drafting losslessly; ``--device`` checked before anything loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_service.eagle3_head import is_eagle3_dir, load_eagle3_head
from draft_service.head_layer import HeadCache
from draft_service.training.__main__ import parse_args, training_device
from draft_service.training.distill_data import distil_batch
from draft_service.training.eagle3_train import (
    feature_layers,
    new_head,
    save_eagle3,
    top1_agreement,
    train_eagle3,
    unrolled_logits,
)
from draft_service.training.settings import TrainSettings
from specserve.model_loading import vocab_fingerprint
from specserve.sampling import SamplingParams
from tests.conftest import plain_decode, tiny_llama
from tests.unit.test_eagle3_head import generate_with

VOCAB = 48
TARGET = tiny_llama(vocab_size=VOCAB, seed=5, layers=6, context=256)
EMBEDDING = TARGET.get_input_embeddings().weight.detach()  # type: ignore[operator]
LM_HEAD = TARGET.get_output_embeddings().weight.detach()
LAYERS = feature_layers(TARGET.config)  # (2, 3, 3) for 6 layers
TINY = TrainSettings(
    draft_vocab_size=32, intermediate_size=96, window=32, batch_size=4, learning_rate=3e-3, epochs=4, unroll_steps=2
)


def distilled(count: int, length: int = 40) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB - 1, (6,), generator=generator).tolist() for _ in range(count)]
    return distil_batch(TARGET, prompts, length, frozenset(), 0, layers=LAYERS)


def test_distillation_stores_the_named_layers_inputs_and_the_final_states_greedy_tokens() -> None:
    """Each position's feature is hidden_states[k] of the layers concatenated (what the verifier returns an
    EAGLE-3 head), its label the target's greedy token, as for our head."""
    assert LAYERS == (2, 3, 3)
    for row in distil_batch(TARGET, [[1, 2, 3], [5, 6, 7, 8, 9]], 10, frozenset(), 0, layers=LAYERS):
        tokens = row["tokens"]
        assert isinstance(tokens, torch.Tensor)
        out = TARGET(input_ids=tokens[None].long(), output_hidden_states=True)
        want = torch.cat([out.hidden_states[k][0] for k in LAYERS], dim=-1)
        torch.testing.assert_close(row["features"].float(), want, rtol=1e-2, atol=1e-2)
        assert row["argmax"].tolist() == out.logits[0].argmax(-1).tolist()


def test_the_training_time_test_computes_the_chained_drafts_the_drafter_serves() -> None:
    """Step 2 of the unrolled forward at position s is ``step`` over the true context up to s - 1, then the
    head's own output fed back with the next token: the served computation, through the served module."""
    torch.manual_seed(0)
    head, _ = new_head(TARGET.config, EMBEDDING, LM_HEAD, torch.arange(0, VOCAB, 2), 96)
    sequence = distilled(1)[0]
    features, tokens = sequence["features"].float()[:12], sequence["tokens"][1:13].long()
    with torch.no_grad():
        first, second = unrolled_logits(head, features, tokens, 2)
        for s in (1, 5, 11):
            cache = HeadCache()
            context = head.step(features[:s], tokens[:s], torch.arange(s), cache)
            torch.testing.assert_close(context.logits[0, -1], first[s - 1], rtol=1e-4, atol=1e-4)
            deeper = head.step(context.features[0, -1:], tokens[s : s + 1], torch.tensor([s]), cache)
            torch.testing.assert_close(deeper.logits[0, -1], second[s], rtol=1e-4, atol=1e-4)


def test_an_eagle3_head_trains_and_its_directory_drafts_losslessly(tmp_path: Path) -> None:
    data = distilled(16)
    head, config, report = train_eagle3(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path / "ckpt", TINY)
    assert report.steps > 0 and len(report.final_accuracy_by_step) == 2
    untrained, _ = new_head(TARGET.config, EMBEDDING, LM_HEAD, head.draft_vocab, 96)
    assert top1_agreement(head, data) > top1_agreement(untrained, data)  # it learned something from the target
    out = save_eagle3(head, config, tmp_path / "head", torch.float32)
    assert is_eagle3_dir(out)
    written = json.loads((out / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == list(LAYERS) and written["torch_dtype"] == "float32"
    loaded = load_eagle3_head(out, target_fingerprint="fp", embedding=EMBEDDING, target_layers=6)
    assert loaded.feature_layers == LAYERS and torch.equal(loaded.draft_vocab, head.draft_vocab)
    features, tokens = data[0]["features"].float()[:20], data[0]["tokens"][1:21].long()
    with torch.no_grad():  # the function trained is the function loaded
        torch.testing.assert_close(
            unrolled_logits(loaded, features, tokens, 1)[0], unrolled_logits(head, features, tokens, 1)[0]
        )
    prompt = [3, 9, 4, 1, 7, 2]
    generated, stats = generate_with(loaded, TARGET, prompt, 32)
    assert generated == plain_decode(TARGET, prompt, 32, SamplingParams())
    assert stats.num_draft_tokens > 0 and not stats.drafter_error


def test_training_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    data = distilled(8)
    settings = replace(TINY, epochs=1, checkpoint_every=1)
    _, _, done = train_eagle3(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path, settings)
    assert done.steps > 0 and done.resumed_from_step == 0
    # A second run into the same directory with the same settings continues where the first stopped.
    _, _, report = train_eagle3(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path, settings)
    assert report.resumed_from_step == done.steps == report.steps
    with pytest.raises(ValueError, match="other settings"):
        train_eagle3(data, EMBEDDING, LM_HEAD, TARGET.config, tmp_path, replace(settings, learning_rate=1e-3))


def test_a_target_too_shallow_for_three_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="a target of 2 decoder layers"):
        feature_layers(tiny_llama(layers=2).config)


def test_device_is_checked_before_the_target_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device(None) == "cpu" and training_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device cuda: this process can use no CUDA device; pass --device cpu"):
        training_device("cuda")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--device", "cuda:1"])
    assert exit_.value.code == 2 and "pass --device cpu" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a device name"):
        training_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert training_device(None) == "cuda" and training_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="sees 2 CUDA device\\(s\\); pass cuda:0 to cuda:1 or cpu"):
        training_device("cuda:2")
    with pytest.raises(ValueError, match="pass --device cpu or --device cuda"):
        training_device("meta")


def test_the_format_flag_keeps_our_head_the_default_and_refuses_what_eagle3_cannot_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ours = parse_args(["--device", "cpu"])
    assert ours.format == "specserve" and ours.intermediate_size == 1024 and ours.out is None
    eagle = parse_args(["--device", "cpu", "--format", "eagle3"])
    assert eagle.intermediate_size == 0  # the target's
    with pytest.raises(SystemExit):
        parse_args(["--format", "eagle3", "--init-from", "head.pt"])
    assert "cannot seed --format eagle3" in capsys.readouterr().err


def test_train_draft_format_eagle3_writes_a_directory_the_drafter_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command end to end on a tiny target (its prompt mix stubbed: the datasets are downloads): distil
    the three layers, train, evaluate, write the directory; the drafter loads it and drafts losslessly."""
    from draft_service import main as drafter_main
    from draft_service.config import DrafterConfig
    from draft_service.eagle3_head import Eagle3Head
    from draft_service.training import __main__ as train_draft
    from tests.unit.test_eagle3_head import TARGET as SAVED_TARGET
    from tests.unit.test_eagle3_head import save_target

    target_dir, tokenizer = save_target(tmp_path / "target")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, VOCAB - 1, (6,), generator=generator).tolist() for _ in range(12)]
    sources = {tuple(p): "templates" for p in prompts}
    monkeypatch.setattr(train_draft, "prompt_mix", lambda args, tokenizer: (prompts[:4], prompts[4:], sources))
    out = tmp_path / "head"
    flags = ["--model", str(target_dir), "--format", "eagle3", "--device", "cpu", "--dtype", "float32"]
    flags += ["--prompts", "8", "--held-out", "4", "--max-new-tokens", "24", "--batch-size", "4", "--epochs", "8"]
    flags += [
        "--draft-vocab",
        "32",
        "--intermediate-size",
        "96",
        "--unroll-steps",
        "2",
        "--learning-rate",
        "3e-3",
        "--no-progress",
    ]
    flags += ["--data-dir", str(tmp_path / "data"), "--out", str(out), "--torch-threads", str(torch.get_num_threads())]
    assert train_draft.main(flags) == 0
    figures = json.loads((out / "training.json").read_text())
    assert figures["format"] == "eagle3" and figures["feature_layers"] == [2, 3, 3]
    assert figures["training"]["steps"] > 0 and figures["held_out"]["tree"]["acceptance_length"] >= 1.0
    config = DrafterConfig(
        sources=("draft_model",), draft_head_path=str(out), target_model=str(target_dir), head_dtype="float32"
    )
    head = drafter_main.load_head(config)
    assert isinstance(head, Eagle3Head) and head.draft_vocab.numel() == 32
    assert head.target_fingerprint == vocab_fingerprint(tokenizer)
    head.target_fingerprint = "fp"  # the vocabulary generate_with's sessions name
    prompt = [5, 3, 5, 8, 9, 7]
    generated, stats = generate_with(head, SAVED_TARGET, prompt, 24)
    assert generated == plain_decode(SAVED_TARGET, prompt, 24, SamplingParams())
    assert stats.num_draft_tokens > 0
