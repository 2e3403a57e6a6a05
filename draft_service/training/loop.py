"""The optimisation loop both head formats train with, resumably (``train.train``, ``eagle3_train.train_eagle3``).

What differs between the formats is the head and its loss over a batch of windows; what is the same lives
here once: AdamW, the data order (shuffled per epoch from the seed, so a resumed run sees what the first run
would have), the learning-rate schedule (warm-up, then cosine to 10% over the epochs or the time budget,
whichever ends first), gradient clipping, and the checkpoint (head, optimiser, draft vocabulary, step,
minutes spent) written every ``checkpoint_every`` steps and when the budget runs out. A second run into the
same checkpoint with the same settings continues from it; other settings are refused, since the data order
and the schedule would no longer be the ones the checkpoint was written under.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draft_service.training.settings import TrainSettings

CHECKPOINT_FILE = "checkpoint.pt"

# The loss of one batch of windows (sequence index, start): a dict with the scalar "loss" to minimise and the
# figures a report keeps ("accuracy_by_step" at least).
BatchLoss = Callable[[Sequence[tuple[int, int]]], dict[str, Any]]


@dataclass
class LoopResult:
    steps: int  # over every run into the checkpoint
    steps_per_epoch: int
    minutes: float  # training time over every run into the checkpoint
    last: dict[str, Any]  # the last batch's losses (NaN when no step ran)
    resumed_from: int  # the step this run started at


def read_checkpoint(out_dir: Path, settings: TrainSettings) -> dict[str, Any] | None:
    """The checkpoint in ``out_dir`` (created when missing), or None; ValueError when it was written with other
    settings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CHECKPOINT_FILE
    if not path.exists():
        return None
    checkpoint: dict[str, Any] = torch.load(path, weights_only=True)
    if checkpoint["settings"] != asdict(settings):
        raise ValueError(
            f"{path} was written with other settings ({checkpoint['settings']}); "
            "remove it or train into another directory"
        )
    return checkpoint


def lr_factor(done: float, warmup: float = 0.02) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to 10%."""
    if done < warmup:
        return (done + 1e-3) / (warmup + 1e-3)
    decayed = min(1.0, (done - warmup) / (1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * decayed))


def optimise(
    head: torch.nn.Module,
    batch_loss: BatchLoss,
    spans: Sequence[tuple[int, int]],
    settings: TrainSettings,
    out_dir: Path,
    checkpoint: dict[str, Any] | None,
    draft_vocab: torch.Tensor,
    device: torch.device,
    progress: bool | None = None,
    desc: str = "train",
) -> LoopResult:
    """Train ``head`` (already on ``device``) on ``spans`` in batches of ``settings.batch_size`` until the epochs
    or the time budget run out, starting from ``checkpoint`` (``read_checkpoint``'s) when given."""
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad],
        lr=settings.learning_rate,
        weight_decay=settings.weight_decay,
    )
    steps_per_epoch = math.ceil(len(spans) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    step, spent = 0, 0.0
    if checkpoint is not None:
        head.load_state_dict(checkpoint["head"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        spent, step = float(checkpoint["minutes"]), int(checkpoint["step"])
    resumed_from = step
    started = time.monotonic()

    def minutes() -> float:
        """Training time over all runs into this checkpoint."""
        return spent + (time.monotonic() - started) / 60

    def save() -> None:
        state = {
            "settings": asdict(settings),
            "draft_vocab": draft_vocab,
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "minutes": minutes(),
            "step": step,
        }
        path = out_dir / CHECKPOINT_FILE
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)

    last: dict[str, Any] = {"loss": torch.tensor(math.nan), "accuracy_by_step": []}
    head.train()
    disable = None if progress is None else not progress
    with tqdm(total=total_steps, initial=step, unit="step", desc=desc, disable=disable) as bar:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            order = list(range(len(spans)))
            random.Random(settings.seed + epoch).shuffle(order)  # the same order when resumed
            chosen = [spans[i] for i in order[offset * settings.batch_size : (offset + 1) * settings.batch_size]]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.autocast_bf16):
                last = batch_loss(chosen)
            # The schedule runs to the end of the epochs or of the time budget, whichever comes first.
            done = max(step / total_steps, minutes() / settings.max_minutes)
            for group in optimizer.param_groups:
                group["lr"] = settings.learning_rate * lr_factor(done)
            optimizer.zero_grad(set_to_none=True)
            last["loss"].backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step += 1
            bar.update()
            accuracy = "/".join(f"{a:.2f}" for a in last["accuracy_by_step"])
            bar.set_postfix(loss=f"{float(last['loss'].detach()):.3f}", acc=accuracy)
            if step % settings.checkpoint_every == 0:
                save()
            if minutes() >= settings.max_minutes:
                break
    save()
    return LoopResult(step, steps_per_epoch, minutes(), last, resumed_from)
