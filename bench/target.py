"""The target as every harness loads it, and the helpers the harnesses share around it.

A ``TargetText`` is the tokenizer side (enough to encode prompts and check
outputs, and where the weights are); a ``Target`` adds the weights in one
dtype. The draft head loads over a target's embedding and LM head here too,
and Spec-Bench prompts become chat-formatted ``Case``s as the coordinator
encodes them.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from coordinator.prompts import ChatTurn, encode_prompt
from draft_service.draft_head import DraftHead, DraftHeadError, in_serving_dtype, load_draft_head
from specserve.model_loading import (
    ModelSource,
    default_cache_root,
    eos_token_ids,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)

from .dataset import load_questions, select
from .decoding import Fp32Head
from .head_identity import draft_head_path

FLOAT32 = "float32"
# The harnesses run their targets on this process's CPU unless told otherwise (``bench.run --device cuda``);
# a cluster's verifier is a process of its own.
DEVICE = "cpu"
# One short unrelated generation before measuring pays each engine's one-off start-up costs.
WARM_UP_TEXT = "Say hello in one short sentence."
WARM_UP_TOKENS = 8


def quiet_libraries() -> None:
    """No hub access, no weight-loading bars or advisory warnings in the benchmark's output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_dtype(model: Any) -> str:
    """A model's parameter dtype as the verifier names it ("float32", "bfloat16")."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def target_source(name: str) -> ModelSource:
    """Where the target named by ``--model`` ('smollm2' or a path) lives, converted to a directory once."""
    return materialize(resolve_model(name), default_cache_root())


@dataclass(frozen=True)
class TargetText:
    """The target's tokenizer side and where its weights are; the weights load on demand (``with_model``)."""

    name: str
    source: ModelSource
    tokenizer: Any
    fingerprint: str
    eos_ids: frozenset[int]

    @property
    def eos_id(self) -> int:
        return min(self.eos_ids)

    def load_model(self, dtype: str = FLOAT32, device: str = DEVICE) -> Any:
        return load_model(self.source, device, dtype)

    def with_model(self, dtype: str = FLOAT32, device: str = DEVICE) -> Target:
        model = self.load_model(dtype, device)
        return Target(self.name, self.source, self.tokenizer, self.fingerprint, self.eos_ids, model)


@dataclass(frozen=True)
class Target(TargetText):
    """The target with its weights loaded in one dtype."""

    model: Any

    @property
    def dtype(self) -> str:
        return model_dtype(self.model)

    @cached_property
    def fp32_head(self) -> Fp32Head:
        """The model's fp32 final norm and LM head (the verifier's numerics), for top-2 gaps and plain decoding."""
        return Fp32Head(self.model)

    @property
    def device(self) -> str:
        return str(self.model.device)

    def fp32_model(self) -> Any:
        """The target in float32 on the same device: the model itself when it is, else a second copy."""
        return self.model if self.dtype == FLOAT32 else self.load_model(FLOAT32, self.device)


def load_target_text(name: str) -> TargetText:
    source = target_source(name)
    tokenizer = load_tokenizer(source)
    return TargetText(name, source, tokenizer, vocab_fingerprint(tokenizer), eos_token_ids(source, tokenizer))


def load_target(name: str, dtype: str = FLOAT32, device: str = DEVICE) -> Target:
    return load_target_text(name).with_model(dtype, device)


def load_head(
    model: Any,
    fingerprint: str,
    path: Path | None = None,
    *,
    serving: bool = True,
    head_matmul: str = "auto",
    device: str = "cpu",
) -> DraftHead:
    """The draft head at ``path`` (default: the one a drafter started here loads) over ``model``'s embedding and
    LM head in fp32; computing on ``device`` in the dtype the draft service picks there with its products as
    ``head_matmul`` says (``serving``), else as loaded (fp32, on the CPU, products unpacked). Raises DraftHeadError
    when there is no usable head. ``device`` is the drafter's ``--device``, wherever ``model`` is."""
    head, _ = load_draft_head(
        draft_head_path() if path is None else path,
        target_fingerprint=fingerprint,
        embedding=model.get_input_embeddings().weight.detach().float().cpu(),
        lm_head=model.get_output_embeddings().weight.detach().float().cpu(),
    )
    return in_serving_dtype(head, head_matmul=head_matmul, device=device)[0] if serving else head


def draft_head(target: Target, fp32: Any, head_matmul: str = "auto", device: str = "cpu") -> DraftHead:
    """The drafter's default draft head over the float32 target ``fp32``, as a drafter on ``device`` computes it
    (``--head-matmul``: ``head_matmul``); the harness stops with the reason when there is none."""
    try:
        return load_head(fp32, target.fingerprint, head_matmul=head_matmul, device=device)
    except DraftHeadError as exc:
        raise SystemExit(f"error: the draft_model source needs its head: {exc}") from exc


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as one user turn, chat-formatted and tokenized as the coordinator does."""
    return encode_prompt(tokenizer, None, [ChatTurn("user", text)])


def turns_ids(tokenizer: Any, turns: Sequence[tuple[str, str]]) -> list[int]:
    """(role, content) turns (an agent's conversation), chat-formatted and tokenized as the coordinator does."""
    return encode_prompt(tokenizer, None, [ChatTurn(role, content) for role, content in turns])


@dataclass(frozen=True)
class Case:
    """One prompt: where it came from and its chat-formatted token ids."""

    index: int
    category: str
    question_id: int
    text: str
    token_ids: list[int]


def make_cases(tokenizer: Any, categories: Sequence[str], count: int) -> list[Case]:
    """Up to ``count`` Spec-Bench prompts, round-robin over ``categories``, chat-formatted as the coordinator does."""
    questions = select(load_questions(), categories, math.ceil(count / len(categories)))[:count]
    return [Case(i, q.category, q.question_id, q.text, chat_ids(tokenizer, q.text)) for i, q in enumerate(questions)]
