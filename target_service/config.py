"""The verifier's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    port: int = 50053
    model: str = "smollm2"  # "smollm2" (packaged GGUF), a .gguf file, or an HF directory
    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: str | None = None  # where GGUF models are converted once; None: default cache
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_tree_nodes: int = 64
    max_tree_depth: int = 32
    max_session_tokens: int = 0  # 0: the model's context length
    torch_threads: int = 0  # 0: torch's default
    max_workers: int = 16  # concurrent RPCs; forwards are serialized on the model
    metrics_port: int = 0  # 0: no Prometheus endpoint
