"""Prompt handling: chat template, tokenization and request validation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.rounds import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class PromptLimits:
    max_new_tokens: int  # configured ceiling per request
    max_session_tokens: int  # the verifier's context limit


def encode_prompt(tokenizer: Any, prompt: str | None, chat: Sequence[ChatTurn] | None) -> list[int]:
    """Token ids of a raw prompt, or of chat turns formatted with the model's chat template."""
    if chat:
        for i, turn in enumerate(chat):
            if turn.role not in CHAT_ROLES:
                raise InvalidArgument(f"chat message {i} has role {turn.role!r}; use one of {', '.join(CHAT_ROLES)}")
        messages = [{"role": turn.role, "content": turn.content} for turn in chat]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
    if not prompt:
        raise InvalidArgument("the prompt is empty: send a non-empty `prompt` or at least one chat message")
    ids = tokenizer(prompt)["input_ids"]
    return ids


def build_request(
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
    limits: PromptLimits,
) -> GenerationRequest:
    if not prompt_ids:
        raise InvalidArgument("the prompt encodes to no tokens")
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > limits.max_session_tokens:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
            f"model's context of {limits.max_session_tokens} tokens: shorten the prompt or ask for fewer tokens"
        )
    try:
        sampling.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return GenerationRequest(prompt_ids, max_new_tokens, sampling, tuple(stop))


def eos_token_ids(tokenizer: Any, generation_config: Any | None = None) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's, plus any the model's generation config lists."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return frozenset(ids)
