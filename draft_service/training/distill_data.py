"""Self-distillation data: the target's own responses and its hidden features.

For each training prompt the target answers (Seq-KD: the draft head learns
what the target says, not what a dataset says), greedily or, to get more than
one answer out of a prompt, by sampling at a temperature, in batches with left
padding because batched decoding is many times cheaper per token on a CPU.
The same pass keeps, for every position t, the target's feature f_t (its
last hidden state after the final norm) and its greedy token after t, which
is what the head is trained to draft whichever token the answer went on with. A
shard (one batch) is written as it finishes, so an interrupted run resumes
where it stopped.

A shard holds a list of sequences, each a dict:
    tokens   int32 [n]        prompt and response token ids
    features float16 [n, d]   f_t for every position (with ``layers``: the named
                              layers' inputs, [n, len(layers) * d])
    argmax   int32 [n]        the target's greedy next token after position t
                              (equal to tokens[t + 1] in a greedy answer)
    prompt_length int
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SAMPLE_TOP_K = 64  # a sampled answer's next token comes from the target's this many likeliest


@dataclass(frozen=True)
class DistillSettings:
    max_new_tokens: int = 128  # Spec-Bench's answers are as long
    batch_size: int = 256  # 2 EPYC cores decoded ~25x more tokens per second at 256 rows than at 1
    max_prompt_tokens: int = 320  # longer prompts are skipped: they would pad a whole batch
    max_minutes: float = 60.0  # no new training shard is started after this long
    temperature: float = 0.0  # 0: greedy answers; above 0: sampled ones (the labels stay the greedy tokens)
    # The target layers whose inputs are stored as the features, concatenated (an EAGLE-3 head's low, mid and
    # high layers); empty: the final hidden state after the norm (our head's f_t).
    layers: tuple[int, ...] = ()


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """A one-turn chat prompt as the coordinator encodes it (the model's chat template)."""
    formatted = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer(formatted, add_special_tokens=False)["input_ids"]
    return ids


def pad_id(tokenizer: Any, eos_ids: Iterable[int]) -> int:
    """The id batches are left-padded with: the tokenizer's pad token, else its smallest end-of-sequence id."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else min(eos_ids)


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


class _PreallocatedLayer(DynamicLayer):
    """A KV cache layer written in place into storage sized for the whole answer.

    DynamicLayer concatenates: every decode step copies the layer's whole
    cache. With 256 rows of 400 positions that is 5 GB of copying per step,
    which made batched distillation memory-bound on a CPU. Here a step writes
    its one position; ``keys`` and ``values`` are views of the filled part.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[3])
            self._key_store = key_states.new_empty(shape)
            self._value_store = value_states.new_empty(shape)
            self.is_initialized = True
        end = self.length + key_states.shape[-2]
        self._key_store[:, :, self.length : end] = key_states
        self._value_store[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._key_store[:, :, :end], self._value_store[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._key_store, self._value_store = self._key_store[indices], self._value_store[indices]
            self.keys = self._key_store[:, :, : self.length]
            self.values = self._value_store[:, :, : self.length]


def _preallocated_cache(model: Any, capacity: int) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_PreallocatedLayer(capacity) for _ in range(model.config.num_hidden_layers)]
    return cache


class _FinalNormTap:
    """Keeps the output of the target's final norm (f_t: what its LM head reads) of every forward."""

    def __init__(self, model: Any) -> None:
        self.output: torch.Tensor | None = None
        self._handle = model.model.norm.register_forward_hook(self._keep)

    def _keep(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        self.output = output

    def take(self) -> torch.Tensor:
        out, self.output = self.output, None
        if out is None:
            raise RuntimeError("the target's final norm did not run")
        return out

    def close(self) -> None:
        self._handle.remove()


@torch.inference_mode()
def distil_batch(
    model: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    pad_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    layers: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """The target's answer to each prompt with its feature and greedy token at every position.

    The answer is greedy at ``temperature`` 0, else sampled (with ``generator``)
    from the target's distribution at that temperature over its
    ``SAMPLE_TOP_K`` likeliest tokens; ``argmax`` always holds the greedy
    token, the one a drafter serving greedy decoding must guess. Sampled
    answers give a prompt further, different contexts: a second pass over
    prompts that were already distilled greedily is new data.

    With ``layers`` (an EAGLE-3 head's), a position's stored feature is the
    residual stream entering each of those decoder layers, concatenated
    (transformers' ``hidden_states[k]``, as the verifier returns them), so the
    forwards also return their hidden states; the greedy tokens still come
    from the final hidden state.

    One pass does it all: a left-padded prefill, then one batched decode step
    per token. A hook on the final norm keeps each step's features, so no
    second forward over the finished sequences is needed, and a row that
    reaches EOS leaves the batch (its cache rows are dropped), so finished
    answers cost nothing. A sequence holds the prompt and every response token
    but the last: the last one's feature is never computed, and its greedy
    token is the previous position's ``argmax``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be 0 or more, not {temperature}")
    pick = _Picker(temperature, generator)
    tap = _FinalNormTap(model)
    try:
        return _distil(model, tap, prompts, max_new_tokens, eos_ids, pad_id, pick, layers)
    finally:
        tap.close()


def _distil(
    model: Any,
    tap: _FinalNormTap,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    pad_id: int,
    pick: _Picker,
    layers: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    device = next(model.parameters()).device
    input_ids, mask = _left_pad(prompts, pad_id)
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # each row from 0, as when served alone
    cache = _preallocated_cache(model, input_ids.shape[1] + max_new_tokens)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        logits_to_keep=1,
        output_hidden_states=bool(layers),
    )
    prompt_final = tap.take()
    prompt_features = _stored(out, prompt_final, layers)
    width = input_ids.shape[1]
    lm_head = model.get_output_embeddings().weight
    rows = len(prompts)
    hidden = prompt_features.shape[-1]
    answer_features = torch.zeros(rows, max_new_tokens, hidden, dtype=torch.float16)
    answers: list[list[int]] = [[] for _ in range(rows)]
    greedy: list[list[int]] = [[] for _ in range(rows)]  # the target's greedy token at each answer step
    slots = torch.arange(rows)  # the prompt of each row of the running batch
    finished = torch.zeros(rows, dtype=torch.bool)  # by prompt
    best, next_tokens = pick(out.logits[:, -1])
    position = positions[:, -1]
    for step in range(max_new_tokens):
        for row, token, top in zip(slots.tolist(), next_tokens.tolist(), best.tolist(), strict=True):
            if not finished[row]:
                answers[row].append(token)
                greedy[row].append(top)
                finished[row] = token in eos_ids or step + 1 == max_new_tokens
        running = ~finished[slots]
        if not running.any():
            break
        # Finished rows leave the batch once an eighth of it has finished: each compaction copies the cache.
        if int((~running).sum()) * 8 >= len(slots):
            keep = running.nonzero().flatten()
            on_device = keep.to(device)
            cache.batch_select_indices(on_device)
            slots, running = slots[keep], running[keep]
            next_tokens, best = next_tokens[on_device], best[on_device]
            mask, position = mask[on_device], position[on_device]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        out = model(
            input_ids=next_tokens[:, None],
            attention_mask=mask,
            position_ids=position[:, None],
            past_key_values=cache,
            output_hidden_states=bool(layers),
        )
        features = _stored(out, tap.take(), layers)[:, -1].to("cpu", torch.float16)
        answer_features[slots[running], step] = features[running]
        best, next_tokens = pick(out.logits[:, -1])
    result = []
    for row, prompt in enumerate(prompts):
        features = prompt_features[row, width - len(prompt) :]
        final = prompt_final[row, width - len(prompt) :]
        # The target's greedy token after each prompt position but the last, from its final hidden states.
        prompt_argmax = (final[:-1].to(lm_head.dtype) @ lm_head.T).argmax(dim=-1).to("cpu", torch.int32)
        answer = answers[row]
        result.append(
            {
                "tokens": torch.tensor(prompt + answer[:-1], dtype=torch.int32),
                "features": torch.cat(
                    [features.to("cpu", torch.float16), answer_features[row, : len(answer) - 1]]
                ).clone(),
                "argmax": torch.cat([prompt_argmax, torch.tensor(greedy[row], dtype=torch.int32)]),
                "prompt_length": len(prompt),
            }
        )
    return result


def _stored(out: Any, final: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The features a forward stores: ``final`` (the final norm's output), or the inputs of ``layers``
    concatenated [batch, positions, len(layers) * hidden]."""
    if not layers:
        return final
    return torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)


class _Picker:
    """(greedy token, token the answer goes on with) from each row's logits: the same at temperature 0.

    A sampled token comes from the ``SAMPLE_TOP_K`` most likely: a softmax and a
    multinomial draw over the whole vocabulary of 256 rows took half a second
    a step on a CPU, several times the forward, and at the temperatures that
    give sensible answers the tail beyond them holds almost nothing.
    """

    def __init__(self, temperature: float, generator: torch.Generator | None) -> None:
        self.temperature = temperature
        self.generator = generator

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best = logits.argmax(dim=-1)  # argmax, not the top-k's first: ties resolve as greedy decoding's do
        if self.temperature == 0:
            return best, best
        top, ids = logits.topk(min(SAMPLE_TOP_K, logits.shape[-1]), dim=-1)
        probs = torch.softmax(top.float() / self.temperature, dim=-1).cpu()
        pick = torch.multinomial(probs, 1, generator=self.generator)
        return best, ids.gather(-1, pick.to(ids.device)).flatten()


def length_sorted_batches(prompts: Sequence[list[int]], batch_size: int, group: int = 8) -> list[list[list[int]]]:
    """Batches in the given order of groups of ``group`` batches, sorted by length within a group.

    Rows of similar length pad each other little, while the coarse order (the
    mix of sources) is kept, so a run cut short still has a representative sample.
    """
    batches = []
    for start in range(0, len(prompts), batch_size * group):
        chunk = sorted(prompts[start : start + batch_size * group], key=len)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


def generate_shards(
    model: Any,
    batches: Sequence[Sequence[list[int]]],
    eos_ids: frozenset[int],
    pad_id: int,
    data_dir: Path,
    settings: DistillSettings = DistillSettings(),
    progress: bool | None = None,
    max_minutes: float | None = None,
) -> list[Path]:
    """One shard per batch of encoded prompts in ``data_dir``; shards already there are kept (resume).

    Returns the shards that exist: every batch's, unless ``max_minutes`` ran out first.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    paths = []
    done_tokens = 0
    with tqdm(
        total=sum(len(b) for b in batches),
        unit="prompt",
        desc=f"distil {data_dir.name}",
        disable=None if progress is None else not progress,
    ) as bar:
        for index, prompts in enumerate(batches):
            path = shard_path(data_dir, index)
            if not path.exists():
                if max_minutes is not None and (time.monotonic() - started) / 60 >= max_minutes:
                    break
                shard_started = time.monotonic()
                generator = torch.Generator().manual_seed(index)  # a resumed run samples the same answers
                shard = distil_batch(
                    model,
                    prompts,
                    settings.max_new_tokens,
                    eos_ids,
                    pad_id,
                    settings.temperature,
                    generator,
                    settings.layers,
                )
                done_tokens += sum(int(row["tokens"].shape[0]) - int(row["prompt_length"]) + 1 for row in shard)
                tmp = path.with_suffix(".tmp")
                torch.save(shard, tmp)
                tmp.replace(path)
                _record_seconds(data_dir, index, time.monotonic() - shard_started)
                minutes = (time.monotonic() - started) / 60
                bar.set_postfix(answer_tok_s=f"{done_tokens / max(1e-9, minutes * 60):.0f}")
            paths.append(path)
            bar.update(len(prompts))
    return paths


def _record_seconds(data_dir: Path, index: int, seconds: float) -> None:
    path = data_dir / "seconds.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record[str(index)] = round(seconds, 1)
    path.write_text(json.dumps(record))


def distill_minutes(data_dir: Path, shards: int) -> float:
    """Minutes spent distilling the first ``shards`` shards of ``data_dir``, over all runs."""
    path = data_dir / "seconds.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    return sum(float(record.get(str(i), 0.0)) for i in range(shards)) / 60


def load_shards(paths: Sequence[Path]) -> list[dict[str, Any]]:
    sequences: list[dict[str, Any]] = []
    for path in paths:
        sequences += torch.load(path, weights_only=True)
    return sequences
