"""The verifier's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.auth.config import ServerSecurity
from specserve.drain import DEFAULT_GRACE_S
from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import DEFAULT_MAX_HEALTH_WATCHES, LOOPBACK, VERIFIER_PORT


@dataclass(frozen=True)
class VerifierConfig:
    host: str = LOOPBACK
    port: int = VERIFIER_PORT
    model: str = DEFAULT_MODEL  # "smollm2" (packaged GGUF), a .gguf file, or an HF directory
    device: str = "cpu"
    dtype: str = "auto"  # "auto": bf16 where the hardware runs it natively (CUDA, AMX, AVX512-BF16), else fp32
    cache_dir: str | None = None  # where GGUF models are converted once; None: default cache
    max_sessions: int = 256
    session_ttl_s: float = 600.0
    max_tree_nodes: int = 64
    max_tree_depth: int = 32
    max_session_tokens: int = 0  # 0: the model's context length
    kv_cache_gib: float = 2.0  # preallocated KV cache; pages are committed as sessions fill them
    max_batch_tokens: int = 256  # tokens scored in one engine step (all sessions; long prefills are chunked)
    max_batch_sessions: int = 64  # sessions in one engine step
    admission_timeout_s: float = 30.0  # a prefill waits this long for KV cache memory, then RESOURCE_EXHAUSTED
    evict_idle_s: float = 2.0  # a prefill short of memory may evict sessions idle this long
    profile_cost: bool = True  # measure the engine's cost curve at start-up (sizes the draft budget)
    throughput_guard: bool = True  # keep speculation on only while measured throughput says it wins
    compile: str = "auto"  # auto: prepacked products at static row buckets where the CPU has them; off: eager
    weights: str = "dtype"  # "int8": the layers' products on int8 copies of the weights (CPU, compile auto; opt-in)
    torch_threads: int = 0  # 0: torch's default
    # One OpenMP team: torch off the gRPC thread, the engine's workers spin-wait (target_service.engine_threads)
    dedicated_cores: bool = True
    max_workers: int = 256  # concurrent RPCs (they wait on the engine; forwards are batched)
    metrics_port: int = 0  # 0: no Prometheus endpoint
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS/mTLS, the internal token callers send
    shutdown_grace_s: float = DEFAULT_GRACE_S  # on SIGTERM: in-flight work goes on this long at most
    max_health_watches: int = DEFAULT_MAX_HEALTH_WATCHES  # open Health/Watch streams; more: RESOURCE_EXHAUSTED
