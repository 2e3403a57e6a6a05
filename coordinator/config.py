"""The coordinator's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.ports import VerifierInfo
from coordinator.prompts import PromptLimits
from coordinator.rounds import RoundPolicy
from coordinator.tree_checks import TreeLimits


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    verifier: str = "127.0.0.1:50053"  # gRPC target, e.g. dns:///specserve-verifier:50053
    drafter: str | None = "127.0.0.1:50052"  # None: verifier-only decoding
    model: str = "smollm2"  # where the tokenizer and chat template come from
    cache_dir: str | None = None
    max_new_tokens_limit: int = 4096
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of a prompt, or of a chat's contents together
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    draft_max_nodes: int = 16  # most tree nodes asked of the drafter each round (it sizes trees to pay off)
    successors_top_k: int = 4  # target top tokens per scored position returned for Token Recycling (0: off)
    draft_timeout_ms: int = 1000  # ceiling of the draft timeout; a slower drafter is dropped for the request
    draft_timeout_floor_ms: int = 100  # the timeout follows the drafter's p99 latency, never below this
    drafter_backoff_ms: int = 5000  # a failed drafter is skipped this long, doubling with each failure in a row
    drafter_max_backoff_ms: int = 60_000
    verifier_timeout_s: float = 120.0
    startup_timeout_s: float = 900.0  # how long to wait for the verifier to load its model
    metrics_port: int = 0


def round_policy(config: CoordinatorConfig, verifier: VerifierInfo) -> RoundPolicy:
    """How rounds run, within what the verifier accepts."""
    return RoundPolicy(
        draft_max_nodes=min(config.draft_max_nodes, verifier.max_tree_nodes),
        draft_timeout_s=config.draft_timeout_ms / 1000,
        max_session_tokens=verifier.max_session_tokens,
        successors_top_k=config.successors_top_k,
        tree_limits=TreeLimits.of(verifier),
    )


def prompt_limits(config: CoordinatorConfig, verifier: VerifierInfo) -> PromptLimits:
    return PromptLimits(
        config.max_new_tokens_limit,
        verifier.max_session_tokens,
        max_prompt_bytes=config.max_prompt_bytes,
        max_chat_messages=config.max_chat_messages,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_bytes=config.max_stop_string_bytes,
    )


REQUEST_OVERHEAD_BYTES = 1 << 20
"""Room above --max-prompt-bytes in the largest request the coordinator receives: protobuf framing of up to
--max-chat-messages messages, the stop strings and the other fields. A prompt somewhat over the limit still
arrives and gets the clear INVALID_ARGUMENT; a request far over it is refused by gRPC (RESOURCE_EXHAUSTED)."""


def max_receive_message_bytes(config: CoordinatorConfig) -> int:
    return config.max_prompt_bytes + REQUEST_OVERHEAD_BYTES
