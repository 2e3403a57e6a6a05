"""Training the draft head on self-distillation data, resumably.

Each sequence gives one example per position t: the input is (f_t, x_{t+1}),
the targets are the target's next feature f_{t+1} (smooth L1, as EAGLE) and
its greedy token after t + 1 (cross-entropy over the draft vocabulary, weight
``ce_weight``). Features get small uniform noise (EAGLE's augmentation: at
serving time the head reads its own, imperfect, predictions). A checkpoint
(head, optimiser, step, data order) is written every ``checkpoint_every``
steps and when the time budget runs out; a second run with the same output
directory continues from it.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from draft_service.draft_head import DraftHead, DraftHeadConfig

IGNORE = -100


@dataclass(frozen=True)
class TrainSettings:
    draft_vocab_size: int = 8192
    intermediate_size: int = 0  # 0: the target's
    window: int = 384  # positions per training example (longer sequences are cut)
    batch_size: int = 8
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    feature_noise: float = 0.05
    epochs: int = 24
    max_minutes: float = 30.0
    checkpoint_every: int = 100
    seed: int = 0


@dataclass
class TrainReport:
    steps: int
    epochs_done: float
    minutes: float
    final_loss: float
    final_feature_loss: float
    final_token_accuracy: float  # training batches, teacher-forced, depth 1
    resumed_from_step: int


def build_draft_vocab(sequences: Sequence[dict[str, Any]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the target predicts most often (ties by id), sorted by id."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq["argmax"].tolist())
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:size]
    if len(ranked) < size:  # a small corpus: fill with the lowest unused ids so the shape is fixed
        used = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in used][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def windows(sequences: Sequence[dict[str, Any]], window: int) -> list[tuple[int, int]]:
    """(sequence index, start) of every training window; a window holds window + 1 positions."""
    spans = []
    for index, seq in enumerate(sequences):
        n = int(seq["tokens"].shape[0])
        for start in range(0, max(1, n - 1), window):
            if n - start >= 2:
                spans.append((index, start))
    return spans


def make_batch(
    sequences: Sequence[dict[str, Any]], spans: Sequence[tuple[int, int]], window: int, label_index: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Right-padded inputs and targets for a list of windows."""
    rows = []
    for index, start in spans:
        seq = sequences[index]
        end = min(int(seq["tokens"].shape[0]), start + window + 1)
        rows.append((seq["features"][start:end].float(), seq["tokens"][start:end].long(), seq["argmax"][start:end]))
    width = max(f.shape[0] for f, _, _ in rows) - 1
    hidden = rows[0][0].shape[1]
    batch = {
        "features": torch.zeros(len(rows), width, hidden),
        "next_tokens": torch.zeros(len(rows), width, dtype=torch.long),
        "target_features": torch.zeros(len(rows), width, hidden),
        "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
        "mask": torch.zeros(len(rows), width, dtype=torch.long),
    }
    for row, (features, tokens, argmax) in enumerate(rows):
        n = features.shape[0] - 1
        batch["features"][row, :n] = features[:-1]
        batch["next_tokens"][row, :n] = tokens[1:]
        batch["target_features"][row, :n] = features[1:]
        batch["labels"][row, :n] = label_index[argmax[1:].long()]
        batch["mask"][row, :n] = 1
    return batch


def losses(head: DraftHead, batch: dict[str, torch.Tensor], settings: TrainSettings, noise: bool) -> dict[str, Any]:
    features = batch["features"]
    if noise and settings.feature_noise > 0:
        features = features + (torch.rand_like(features) * 2 - 1) * settings.feature_noise
    out = head(features, batch["next_tokens"], attention_mask=batch["mask"])
    valid = batch["mask"].bool()
    feature_loss = F.smooth_l1_loss(out.features[valid], batch["target_features"][valid])
    labels = batch["labels"][valid]
    logits = out.logits[valid]
    token_loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    scored = labels != IGNORE
    accuracy = (logits.argmax(-1)[scored] == labels[scored]).float().mean() if scored.any() else torch.tensor(0.0)
    return {
        "loss": feature_loss + settings.ce_weight * token_loss,
        "feature_loss": float(feature_loss.detach()),
        "token_loss": float(token_loss.detach()),
        "accuracy": float(accuracy),
    }


def label_index_for(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target token id -> draft vocabulary index, IGNORE for tokens outside it."""
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    index[draft_vocab] = torch.arange(draft_vocab.numel())
    return index


def train(
    sequences: Sequence[dict[str, Any]],
    embedding: torch.Tensor,
    lm_head: torch.Tensor,
    target_config: Any,
    out_dir: Path,
    settings: TrainSettings = TrainSettings(),
    progress: bool | None = None,
) -> tuple[DraftHead, TrainReport]:
    """Train (or continue training) a head; the checkpoint lives in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out_dir / "checkpoint.pt"
    vocab_size = int(embedding.shape[0])
    torch.manual_seed(settings.seed)
    checkpoint = torch.load(checkpoint_path, weights_only=True) if checkpoint_path.exists() else None
    if checkpoint is not None and checkpoint["settings"] != asdict(settings):
        raise ValueError(
            f"{checkpoint_path} was written with other settings ({checkpoint['settings']}); "
            "remove it or train into another directory"
        )
    draft_vocab = (
        checkpoint["draft_vocab"]
        if checkpoint is not None
        else build_draft_vocab(sequences, settings.draft_vocab_size, vocab_size)
    )
    config = DraftHeadConfig.for_target(target_config, int(draft_vocab.numel()), settings.intermediate_size)
    head = DraftHead(config, embedding, lm_head, draft_vocab)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    spans = windows(sequences, settings.window)
    steps_per_epoch = math.ceil(len(spans) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, total_steps))
    step = 0
    if checkpoint is not None:
        head.load_state_dict(checkpoint["head"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        step = int(checkpoint["step"])
    resumed_from = step
    label_index = label_index_for(draft_vocab, vocab_size)

    def save() -> None:
        state = {
            "settings": asdict(settings),
            "draft_vocab": draft_vocab,
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
        }
        torch.save(state, checkpoint_path.with_suffix(".tmp"))
        checkpoint_path.with_suffix(".tmp").replace(checkpoint_path)

    started = time.monotonic()
    last: dict[str, Any] = {"loss": torch.tensor(float("nan")), "feature_loss": math.nan, "accuracy": math.nan}
    head.train()
    disable = None if progress is None else not progress
    with tqdm(total=total_steps, initial=step, unit="step", desc="train", disable=disable) as bar:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            order = list(range(len(spans)))
            random.Random(settings.seed + epoch).shuffle(order)  # the same order when resumed
            chosen = order[offset * settings.batch_size : (offset + 1) * settings.batch_size]
            batch = make_batch(sequences, [spans[i] for i in chosen], settings.window, label_index)
            last = losses(head, batch, settings, noise=True)
            optimizer.zero_grad(set_to_none=True)
            last["loss"].backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{float(last['loss'].detach()):.3f}", acc=f"{last['accuracy']:.2f}")
            if step % settings.checkpoint_every == 0:
                save()
            if (time.monotonic() - started) / 60 >= settings.max_minutes:
                break
    save()
    head.eval()
    report = TrainReport(
        steps=step,
        epochs_done=step / steps_per_epoch,
        minutes=(time.monotonic() - started) / 60,
        final_loss=float(last["loss"].detach()),
        final_feature_loss=float(last["feature_loss"]),
        final_token_accuracy=float(last["accuracy"]),
        resumed_from_step=resumed_from,
    )
    return head, report


def _lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 2% of steps, then cosine decay to 10%."""
    warmup = max(1, total // 50)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
