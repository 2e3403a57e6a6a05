"""The coordinator's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.ports import VerifierInfo
from coordinator.prompts import PromptLimits
from coordinator.rounds import RoundPolicy
from coordinator.tree_checks import TreeLimits
from specserve.drain import DEFAULT_GRACE_S


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    verifier: str = "127.0.0.1:50053"  # gRPC target, e.g. dns:///specserve-verifier:50053
    drafter: str | None = "127.0.0.1:50052"  # None: verifier-only decoding
    model: str = "smollm2"  # where the tokenizer and chat template come from
    cache_dir: str | None = None
    max_new_tokens_limit: int = 4096
    draft_max_nodes: int = 16  # most tree nodes asked of the drafter each round (it sizes trees to pay off)
    successors_top_k: int = 4  # target top tokens per scored position returned for Token Recycling (0: off)
    draft_timeout_ms: int = 1000  # ceiling of the draft timeout; a slower drafter is dropped for the request
    draft_timeout_floor_ms: int = 100  # the timeout follows the drafter's p99 latency, never below this
    drafter_backoff_ms: int = 5000  # a failed drafter is skipped this long, doubling with each failure in a row
    drafter_max_backoff_ms: int = 60_000
    verifier_timeout_s: float = 120.0
    startup_timeout_s: float = 900.0  # how long to wait for the verifier to load its model
    metrics_port: int = 0
    shutdown_grace_s: float = DEFAULT_GRACE_S  # on SIGTERM: in-flight work goes on this long at most


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
    return PromptLimits(config.max_new_tokens_limit, verifier.max_session_tokens)
