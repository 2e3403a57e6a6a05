"""The drafter's settings, declared once: its flags, environment variables and docs table come from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draft_service.drafter import SOURCES
from draft_service.head_products import HEAD_MATMUL_CHOICES
from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import DRAFTER_PORT, ServiceConfig, grpc_port
from specserve.settings import setting

# The committed head for the packaged target (`make train-draft` writes it; it ships as package data).
DEFAULT_DRAFT_HEAD = Path(__file__).resolve().parent / "weights" / "smollm2-draft-head.pt"
HEAD_DTYPE_CHOICES = ("auto", "float32", "bfloat16")
POOL_SHARE = 0.25
"""Of ``max_memory_mib``, what the in-memory n-gram pools may hold (all of them together)."""


@dataclass(frozen=True)
class DrafterConfig(ServiceConfig):
    """The drafter's settings (``specserve.settings``); ``draft_service.main`` parses them once."""

    port: int = grpc_port(DRAFTER_PORT)
    redis_url: str | None = setting(
        None,
        "shared n-gram pool, e.g. redis://127.0.0.1:6379/0 (unset: the embedded in-memory pool)",
        env="SPECSERVE_REDIS_URL",
        shown="in-memory pool",
    )
    redis_timeout_ms: int = setting(50, "budget of one Redis call; slower counts as down")
    pool_key_len: int = setting(3, "n-gram pool shape: tokens in a key")
    pool_continuation_len: int = setting(8, "n-gram pool shape: tokens kept after a key")
    pool_max_keys: int = setting(
        200_000, "keys of an in-memory pool (Redis is bounded by TTL and per-key caps instead)"
    )
    lookup_min_ngram: int = setting(2, "prompt lookup: shortest match")
    lookup_max_ngram: int = setting(4, "prompt lookup: longest match")
    sources: tuple[str, ...] = setting(
        ("suffix", "token_recycling", "lookahead", "draft_model"),
        "comma-separated draft sources (suffix reads the n-gram pool itself: naming ngram_pool too looks it up twice)",
        env="SPECSERVE_DRAFT_SOURCES",
        choices=SOURCES,
    )
    draft_head_path: str = setting(
        str(DEFAULT_DRAFT_HEAD),
        "weights of the draft head (the draft_model source), trained for this target (`make train-draft`), or "
        "a published EAGLE-3 head's directory (config.json with model.safetensors or pytorch_model.bin) made for "
        "this target; a missing, corrupt or foreign file stops the drafter with the reason",
        env="SPECSERVE_DRAFT_HEAD",
        shown="`draft_service/weights/smollm2-draft-head.pt`",
    )
    target_model: str = setting(
        DEFAULT_MODEL,
        "the target the head was trained for (its embedding and LM head are loaded), and whose tokenizer a draft "
        "model must share",
        env="SPECSERVE_MODEL",
    )
    draft_model: str = setting(
        "",
        "a small language model of the target's family (a Hugging Face directory or a .gguf file) drafting as the "
        "draft_lm source, with its own KV cache per session on --device; set, draft_lm joins --sources. A model "
        "whose tokenizer is not --target-model's, or a path that holds none, stops the drafter with the reason",
        env="SPECSERVE_DRAFT_MODEL",
        shown="unset",
    )
    device: str = setting(
        "cpu",
        "where the draft head and the draft model, their per-session state and their tree expansion run: cpu, "
        "cuda or cuda:N (a device this process cannot use stops it at start with what to pass instead; the n-gram "
        "sources run on the host either way)",
        env="SPECSERVE_DRAFTER_DEVICE",
    )
    head_dtype: str = setting(
        "auto",
        "the draft head's compute dtype (auto: bf16 on a GPU or where the CPU has AMX or AVX512-BF16, else fp32)",
        env="SPECSERVE_HEAD_DTYPE",
        choices=HEAD_DTYPE_CHOICES,
    )
    head_logits_matmul: str = setting(
        "auto",
        "how the head's products run: packed: on weights prepacked once at start-up for the CPU's GEMM kernel "
        "(oneDNN; MKL for fp32 on Intel), F.linear where the dtype has none; int8: int8 copies of those weights "
        "(CPU; a draft's numerics can cost acceptance, never exactness); blocks: an fp32 head's weights as Q8_0 "
        "blocks on the block kernel; auto: whichever of packed, int8 and blocks a draft step timed at start-up "
        "runs fastest (another than packed only if at least 10% faster); linear: F.linear everywhere",
        env="SPECSERVE_HEAD_LOGITS_MATMUL",
        flags=("--head-matmul", "--head-logits-matmul"),
        choices=HEAD_MATMUL_CHOICES,
    )
    tree_depth: int = setting(4, "the head's and the draft model's trees: levels (a budget up to it: a chain)")
    tree_branching: int = setting(4, "the head's and the draft model's trees: children per expanded node")
    tree_beam: int = setting(4, "the head's and the draft model's trees: nodes expanded per level")
    torch_threads: int = setting(0, "torch's threads (0: torch's default)", env="SPECSERVE_TORCH_THREADS")
    predraft_outcomes: int = setting(
        3,
        "pre-drafting: while the verifier checks a tree, draft the next round for this many of its likeliest "
        "outcomes; a report that matches one is answered at once (0: off)",
        env="SPECSERVE_PREDRAFT_OUTCOMES",
    )
    coupled_sampling: bool = setting(
        True,
        "for sampled requests the draft head and the draft model draft with the target's keyed Gumbel noise, so "
        "their first candidate is the target's own token far more often; off: their top-k, as under greedy. Output "
        "is the same either way",
        env="SPECSERVE_COUPLED_SAMPLING",
    )
    max_memory_mib: int = setting(
        1024,
        f"bound of the drafter's state: the in-memory n-gram pools ({POOL_SHARE:.0%} of it), per-session drafting "
        "state and the namespaces' successor tables and acceptance statistics; over it the least recently used "
        "sessions lose their draft-head and draft-model state (they draft from n-grams) and namespaces their "
        "tables and statistics",
        env="SPECSERVE_DRAFTER_MAX_MEMORY_MIB",
    )
    max_namespaces: int = setting(
        1024,
        "most (vocabulary, pool namespace) pairs whose in-memory n-gram pool, successor table and acceptance "
        "statistics are kept; beyond it the least recently used pair's are dropped",
        minimum=1,
    )
    stream_idle_timeout_s: float = setting(
        300.0, "a Draft stream that sends nothing this long is closed (DEADLINE_EXCEEDED) and its state freed"
    )
    max_connection_age_s: float = setting(
        30.0,
        "clients reconnect after this long (open streams finish first), and so resolve the drafter Service's DNS "
        "name again: drafter pods added by a scale-up get sessions within about this long",
    )
