"""The drafter's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve.auth.config import ServerSecurity
from specserve.drain import DEFAULT_GRACE_S
from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import DEFAULT_MAX_HEALTH_WATCHES, DRAFTER_PORT, LOOPBACK

# The committed head for the packaged target (`make train-draft` writes it; it ships as package data).
DEFAULT_DRAFT_HEAD = Path(__file__).resolve().parent / "weights" / "smollm2-draft-head.pt"


@dataclass(frozen=True)
class DrafterConfig:
    host: str = LOOPBACK
    port: int = DRAFTER_PORT
    redis_url: str | None = None  # None: the embedded in-memory n-gram pool
    redis_timeout_ms: int = 50  # budget of one Redis call; slower counts as down
    pool_key_len: int = 3
    pool_continuation_len: int = 8
    pool_max_keys: int = 200_000  # in-memory pool only; Redis is bounded by TTL and per-key caps
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 4
    # The suffix source (prompt, output and the tenant's pool in one), token recycling and the draft head, whose
    # weights ship with the drafter (draft_service/weights/); prompt_lookup and ngram_pool are there to name.
    sources: tuple[str, ...] = ("suffix", "token_recycling", "draft_model")
    metrics_port: int = 0
    shutdown_grace_s: float = DEFAULT_GRACE_S  # on SIGTERM: in-flight work goes on this long at most
    max_health_watches: int = DEFAULT_MAX_HEALTH_WATCHES  # open Health/Watch streams; more: RESOURCE_EXHAUSTED
    # The draft_model source: a draft head trained for this target (`make train-draft`).
    draft_head_path: str = str(DEFAULT_DRAFT_HEAD)
    target_model: str = DEFAULT_MODEL  # whose embedding and LM head the head reads (name or local path)
    device: str = "cpu"  # where the head, its per-session state and the tree expansion run: cpu, cuda, cuda:N
    head_dtype: str = "auto"  # the head's compute dtype; auto: bf16 on a GPU, or where the CPU runs it natively
    head_logits_matmul: str = "auto"  # --head-matmul; auto: packed or int8 products, whichever times faster here
    tree_depth: int = 4  # dynamic tree: levels, children per expanded node, nodes expanded per level
    tree_branching: int = 4
    tree_beam: int = 4
    torch_threads: int = 0  # 0: torch's default
    # Outcomes of each tree drafted ahead while the verifier checks it (pre-drafting); 0: off.
    predraft_outcomes: int = 3
    # Sampled sessions: the draft head drafts with the target's keyed Gumbel noise (off: its top-k, as greedy).
    coupled_sampling: bool = True
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS/mTLS, the internal token callers send
    # Bytes of in-memory n-gram pools (POOL_SHARE of it), per-session drafting state and the namespaces' successor
    # tables and acceptance statistics; over it the least recently used sessions' draft-head state is freed (they
    # go on with n-gram drafting), and the least recently used namespaces' tables and statistics.
    max_memory_mib: int = 1024
    # (vocabulary, pool namespace) pairs whose n-gram pool, successor table and acceptance statistics are kept
    # (callers name them); beyond it the least recently used pair's go.
    max_namespaces: int = 1024
    stream_idle_timeout_s: float = 300.0  # a Draft stream silent this long is closed and its state freed
    # A client connection older than this is asked to reconnect (GOAWAY; its open streams finish): coordinators
    # then resolve the drafter Service's DNS name again, so drafter pods added by a scale-up get new sessions.
    max_connection_age_s: float = 30.0


POOL_SHARE = 0.25
"""Of ``max_memory_mib``, what the in-memory n-gram pools may hold (all of them together)."""
