"""The verifier's settings, declared once: its flags, environment variables and docs table come from here."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import VERIFIER_PORT, ServiceConfig, grpc_port
from specserve.settings import setting
from target_service.lookahead import LOOKAHEAD_CHOICES, MAX_NGRAM, MAX_WINDOW
from target_service.model_runner import COMPILE_CHOICES, WEIGHTS_CHOICES

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VerifierConfig(ServiceConfig):
    """The verifier's settings (``specserve.settings``); ``target_service.main`` parses them once."""

    port: int = grpc_port(VERIFIER_PORT)
    model: str = setting(
        DEFAULT_MODEL,
        "'smollm2' (the packaged GGUF), a .gguf file or a Hugging Face model directory",
        env="SPECSERVE_MODEL",
    )
    device: str = setting("cpu", "cpu, cuda, cuda:1 ...", env="SPECSERVE_DEVICE")
    dtype: str = setting(
        "auto",
        "the target's layers; auto: bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32, and fp32 on any "
        "CPU for a GGUF model of Q4_1/Q8_0 blocks (acceptance always reads fp32 logits; see the notes below)",
        env="SPECSERVE_DTYPE",
        choices=DTYPE_CHOICES,
    )
    cache_dir: str | None = setting(
        None, "where GGUF models are converted once", env="SPECSERVE_CACHE_DIR", shown="`~/.cache/specserve`"
    )
    max_sessions: int = setting(256, "sessions held; the least recently used are evicted beyond it")
    session_ttl_s: float = setting(600.0, "a session idle this long is freed")
    kept_prefixes: int = setting(
        32,
        "released sessions' KV caches kept so that a new session of the same caller whose prompt starts with "
        "their tokens (the next turn of a conversation or an agent loop) copies them instead of prefilling "
        "them; the first memory evicted when it is short, freed after --session-ttl-s; 0: off",
        minimum=0,
    )
    max_tree_nodes: int = setting(64, "largest tree verified (nodes)")
    max_tree_depth: int = setting(32, "largest tree verified (depth)")
    max_session_tokens: int = setting(0, "context limit per session (0: the model's)", shown="0 (model context)")
    kv_cache_gib: float = setting(
        2.0,
        "preallocated KV cache for all sessions (pages are committed as they fill); prefills wait for room, then "
        "get RESOURCE_EXHAUSTED. On a CPU it is kept in fp32 whatever the model's dtype",
    )
    max_batch_tokens: int = setting(
        256, "tokens scored in one engine step across sessions (long prefills are chunked to fit)"
    )
    max_batch_sessions: int = setting(64, "sessions in one engine step")
    admission_timeout_s: float = setting(
        30.0, "a prefill short of KV cache memory waits this long, then gets RESOURCE_EXHAUSTED"
    )
    evict_idle_s: float = setting(2.0, "a prefill short of KV cache memory may evict sessions idle this long")
    profile_cost: bool = setting(
        True,
        "measure the engine's cost curve at start-up, which sizes the draft budget (kept in the model cache "
        "after the first start); --no-profile-cost: draft budgets follow the tree limits only",
    )
    throughput_guard: bool = setting(
        True,
        "keep speculation on only while measured throughput says it wins; --no-throughput-guard: size draft "
        "budgets by the cost curve alone",
    )
    lookahead: str = setting(
        "auto",
        "Jacobi lookahead rows (Lookahead Decoding) beside the trees of sessions whose coordinator asks, their "
        "n-grams sent to the drafters' pools and never committed: auto where the measured cost curve says the "
        "extra rows are nearly free (a GPU; off on a CPU), on, off",
        env="SPECSERVE_LOOKAHEAD",
        choices=LOOKAHEAD_CHOICES,
    )
    lookahead_window: int = setting(8, f"columns of a session's lookahead window (W, 1-{MAX_WINDOW})", minimum=1)
    lookahead_ngram: int = setting(
        4,
        f"tokens of each lookahead n-gram (N, 2-{MAX_NGRAM}); the window has N - 1 levels: W x (N - 1) rows",
        minimum=2,
    )
    compile: str = setting(
        "auto",
        "auto: the step's weights prepacked for the CPU's GEMM kernels at static row counts (on a GPU: CUDA "
        "graphs); off: eager F.linear, for debugging and comparison; inductor (CPU, opt-in): the whole step "
        "compiled as one graph by torch.compile at every start-up; use with --dedicated-cores (see the notes below)",
        env="SPECSERVE_COMPILE",
        choices=COMPILE_CHOICES,
    )
    weights: str = setting(
        "dtype",
        "dtype: the layers read the model's weights in --dtype; int8: int8 copies of them (per-channel scales, "
        "bf16 activations in the products; CPU with --compile auto): other weights, so other output than --dtype "
        "alone gives, and not lossless by this project's rule (see the notes below)",
        env="SPECSERVE_WEIGHTS",
        choices=WEIGHTS_CHOICES,
    )
    torch_threads: int = setting(0, "torch's threads (0: torch's default)", env="SPECSERVE_TORCH_THREADS")
    dedicated_cores: bool = setting(
        True,
        "the gRPC thread runs torch on one thread and the engine thread on all, so the process holds one OpenMP "
        "team whose workers spin-wait between regions (with two, libgomp puts them to sleep and every parallel "
        "region waits for a wake-up); --no-dedicated-cores keeps torch's threads on both",
        env="SPECSERVE_DEDICATED_CORES",
    )
    max_workers: int = setting(256, "concurrent RPCs (they wait on the engine; forwards are batched)")
