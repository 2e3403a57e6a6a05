"""Self-distillation data: the target's own greedy responses and its hidden features.

For each training prompt the target answers greedily (Seq-KD: the draft head
learns what the target says, not what a dataset says), in batches with left
padding because batched decoding is several times cheaper per token on a CPU.
One more forward over prompt + response gives, for every position t, the
target's feature f_t (its last hidden state after the final norm) and its
argmax token after t. Shards of a few sequences are written as they finish,
so an interrupted run resumes where it stopped.

A shard holds a list of sequences, each a dict:
    tokens   int32 [n]        prompt and response token ids
    features float16 [n, d]   f_t for every position
    argmax   int32 [n]        the target's greedy next token after position t
    prompt_length int
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class DistillSettings:
    max_new_tokens: int = 192
    batch_size: int = 48


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """A one-turn chat prompt as the coordinator encodes it (the model's chat template)."""
    formatted = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer(formatted, add_special_tokens=False)["input_ids"]
    return ids


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard_{index:05d}.pt"


def _left_pad(batch: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask


@torch.inference_mode()
def greedy_responses(
    model: Any, prompts: Sequence[list[int]], max_new_tokens: int, eos_ids: frozenset[int], pad_id: int
) -> list[list[int]]:
    """The target's greedy answer to each prompt, up to and including its EOS token."""
    input_ids, mask = _left_pad(prompts, pad_id)
    out = model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
    )
    responses = []
    for row in out[:, input_ids.shape[1] :].tolist():
        end = next((i for i, token in enumerate(row) if token in eos_ids), None)
        responses.append(row if end is None else row[: end + 1])
    return responses


@torch.inference_mode()
def features_of(model: Any, sequences: Sequence[list[int]], pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features [n, d] float16, argmax [n] int32) of each full sequence, in one padded forward."""
    input_ids, mask = _left_pad(sequences, pad_id)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # each row from 0, as when served alone
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # after the final norm: what the LM head reads
    argmax = out.logits.argmax(dim=-1)
    width = input_ids.shape[1]
    result = []
    for row, ids in enumerate(sequences):
        start = width - len(ids)
        result.append((hidden[row, start:].to(torch.float16).clone(), argmax[row, start:].to(torch.int32).clone()))
    return result


def _batches(items: Sequence[str], size: int) -> Iterator[tuple[int, Sequence[str]]]:
    for index, start in enumerate(range(0, len(items), size)):
        yield index, items[start : start + size]


def generate_shards(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    eos_ids: frozenset[int],
    data_dir: Path,
    settings: DistillSettings = DistillSettings(),
    progress: bool | None = None,
) -> list[Path]:
    """Write one shard per batch of prompts into ``data_dir``; shards already there are kept (resume)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    paths = []
    batches = list(_batches(prompts, settings.batch_size))
    with tqdm(
        total=len(prompts), unit="prompt", desc="distil", disable=None if progress is None else not progress
    ) as bar:
        for index, texts in batches:
            path = shard_path(data_dir, index)
            paths.append(path)
            if not path.exists():
                encoded = [encode_chat(tokenizer, text) for text in texts]
                responses = greedy_responses(model, encoded, settings.max_new_tokens, eos_ids, pad_id)
                full = [p + r for p, r in zip(encoded, responses, strict=True)]
                rows = features_of(model, full, pad_id)
                shard = [
                    {
                        "tokens": torch.tensor(ids, dtype=torch.int32),
                        "features": features,
                        "argmax": argmax,
                        "prompt_length": len(prompt),
                    }
                    for ids, prompt, (features, argmax) in zip(full, encoded, rows, strict=True)
                ]
                tmp = path.with_suffix(".tmp")
                torch.save(shard, tmp)
                tmp.replace(path)
            bar.update(len(texts))
    return paths


def load_shards(paths: Sequence[Path]) -> list[dict[str, Any]]:
    sequences: list[dict[str, Any]] = []
    for path in paths:
        sequences += torch.load(path, weights_only=True)
    return sequences
