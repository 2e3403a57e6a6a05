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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from draft_service.draft_head import DraftHead, DraftHeadConfig, HeadOutput, load_state, read_weights
from draft_service.training.loop import optimise, read_checkpoint
from draft_service.training.settings import TrainReport, TrainSettings
from specserve.tree_masks import additive_mask

IGNORE = -100


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


def unroll_mask(n: int, step: int) -> torch.Tensor:
    """[n, step * n] bool: what draft step ``step`` (2, 3, ...) at position s may attend to.

    Serving, the head's ``step``-th draft from position s sees the target's
    true entries up to s - step + 1, one entry of each earlier draft step
    (the chain it is extending) and itself. Keys are the blocks of steps
    1..step in order, each of n positions.
    """
    position = torch.arange(n)
    blocks = [position[None, :] <= position[:, None] - step + 1]  # step 1: the true context
    for earlier in range(2, step):
        blocks.append(position[None, :] == position[:, None] - step + earlier)
    blocks.append(position[None, :] == position[:, None])
    return torch.cat(blocks, dim=1)


def unrolled(
    head: DraftHead, features: torch.Tensor, next_tokens: torch.Tensor, mask: torch.Tensor, steps: int
) -> list[HeadOutput]:
    """The head's outputs at every position for draft steps 1..``steps`` (training-time test).

    Step 1 reads the target's features. Step k > 1 at position s reads the
    feature step k - 1 predicted at s - 1 and the same next token, and attends
    as ``unroll_mask`` says through the KV cache of the earlier steps: its
    output is the head's k-th chained draft from the true context up to
    s - k + 1, as serving computes it. Positions s < k - 1 have no such draft.
    """
    cache = DynamicCache() if steps > 1 else None
    outputs = [head(features, next_tokens, attention_mask=mask, past_key_values=cache)]
    width = features.shape[1]
    positions = torch.arange(width, device=features.device)[None].expand(features.shape[0], -1)
    for step in range(2, steps + 1):
        previous = outputs[-1].features
        own = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
        attend = additive_mask(unroll_mask(width, step).to(own.device), own.dtype)
        outputs.append(head(own, next_tokens, position_ids=positions, attention_mask=attend, past_key_values=cache))
    return outputs


def losses(head: DraftHead, batch: dict[str, torch.Tensor], settings: TrainSettings, noise: bool) -> dict[str, Any]:
    """Feature and token losses averaged over the draft steps; the token accuracy of each step."""
    features = batch["features"]
    if noise and settings.feature_noise > 0:
        features = features + (torch.rand_like(features) * 2 - 1) * settings.feature_noise
    valid = batch["mask"].bool()
    positions = torch.arange(features.shape[1], device=features.device)[None]
    total = torch.zeros((), device=features.device)
    accuracy: list[float] = []
    feature_losses: list[float] = []
    outputs = unrolled(head, features, batch["next_tokens"], batch["mask"], settings.unroll_steps)
    for step, out in enumerate(outputs, start=1):
        scored = valid & (positions >= step - 1)
        feature_loss = F.smooth_l1_loss(out.features[scored].float(), batch["target_features"][scored])
        labels = batch["labels"][scored]
        logits = out.logits[scored].float()
        token_loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
        total = total + feature_loss + settings.ce_weight * token_loss
        known = labels != IGNORE
        accuracy.append(float((logits.argmax(-1)[known] == labels[known]).float().mean()) if known.any() else 0.0)
        feature_losses.append(float(feature_loss.detach()))
    return {
        "loss": total / len(outputs),
        "feature_loss": feature_losses[0],
        "accuracy": accuracy[0],
        "accuracy_by_step": accuracy,
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
    settings: TrainSettings | None = None,
    progress: bool | None = None,
    device: str = "cpu",
) -> tuple[DraftHead, TrainReport]:
    """Train (or continue training) a head on ``device``; the checkpoint lives in ``out_dir``. The head comes
    back on the CPU, where it is evaluated and saved (``settings`` None: the defaults)."""
    settings = settings or TrainSettings()
    vocab_size = int(embedding.shape[0])
    torch.manual_seed(settings.seed)
    checkpoint = read_checkpoint(out_dir, settings)
    initial = read_weights(Path(settings.init_from)) if settings.init_from and checkpoint is None else None
    if checkpoint is not None:
        draft_vocab = checkpoint["draft_vocab"]
    elif initial is not None:
        draft_vocab = initial["draft_vocab"].long()  # its LM head rows: the vocabulary goes with the weights
    else:
        draft_vocab = build_draft_vocab(sequences, settings.draft_vocab_size, vocab_size)
    config = DraftHeadConfig.for_target(target_config, int(draft_vocab.numel()), settings.intermediate_size)
    head = DraftHead(config, embedding, lm_head, draft_vocab)
    if initial is not None:
        load_state(head, initial, Path(settings.init_from))
    where = torch.device(device)
    head = head.to(where)
    label_index = label_index_for(draft_vocab, vocab_size)

    def batch_loss(chosen: Sequence[tuple[int, int]]) -> dict[str, Any]:
        batch = make_batch(sequences, chosen, settings.window, label_index)
        return losses(head, {name: tensor.to(where) for name, tensor in batch.items()}, settings, noise=True)

    spans = windows(sequences, settings.window)
    result = optimise(head, batch_loss, spans, settings, out_dir, checkpoint, draft_vocab, where, progress)
    head = head.to("cpu").eval()
    last = result.last
    report = TrainReport(
        steps=result.steps,
        epochs_done=result.steps / result.steps_per_epoch,
        minutes=result.minutes,
        final_loss=float(last["loss"].detach()),
        final_feature_loss=float(last.get("feature_loss", math.nan)),
        final_token_accuracy=float(last.get("accuracy", math.nan)),
        final_accuracy_by_step=list(last.get("accuracy_by_step", [])),
        resumed_from_step=result.resumed_from,
    )
    return head, report
