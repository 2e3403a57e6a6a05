"""Entry point of the verifier: ``python -m target_service``."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc

from specserve.auth.interceptors import InternalTokenInterceptor
from specserve.block_weights import choose_model_dtype
from specserve.drain import Drain
from specserve.health import track_watches
from specserve.lifecycle import internal_token, listen
from specserve.model_loading import (
    default_cache_root,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)
from specserve.rpc import drain_on_signals, mark_serving, server_options, stop_when_drained
from specserve.rpc_errors import ErrorInterceptor
from specserve.service_main import parse_service_config, setup_logging
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from target_service.config import VerifierConfig
from target_service.kept_curve import kept_curve_path, size_budgets
from target_service.lookahead import check_settings
from target_service.metrics import VerifierMetrics
from target_service.server import VerifierServicer
from target_service.verifier import Verifier

log = logging.getLogger("target_service")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


def parse_config(argv: list[str] | None = None) -> tuple[VerifierConfig, str]:
    """The verifier's config from its command line and environment (``VerifierConfig`` declares both)."""
    return parse_service_config(
        VerifierConfig, argv, prog="target_service", description="specserve verifier (target model)", refine=refine
    )


def refine(config: VerifierConfig) -> VerifierConfig:
    """Settings that exclude each other (ValueError saying what to pass instead)."""
    if config.weights == "int8" and (config.compile != "auto" or not config.device.startswith("cpu")):
        raise ValueError("--weights int8 runs on the CPU's packed kernels: use it with --device cpu and --compile auto")
    if config.compile == "inductor" and not config.device.startswith("cpu"):
        raise ValueError("--compile inductor compiles the CPU's step: on a GPU, --compile auto captures CUDA graphs")
    check_settings(config.lookahead, config.lookahead_window, config.lookahead_ngram)
    return config


def build_verifier(config: VerifierConfig) -> Verifier:
    import torch

    from target_service.engine_threads import serve_on_this_thread

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    if config.compile == "inductor" and not config.dedicated_cores:
        log.warning(
            "--compile inductor without --dedicated-cores: its many small parallel regions run with sleeping "
            "OpenMP workers here (measured slower than --compile auto so)"
        )
    if config.dedicated_cores:
        # The engine thread computes on every torch thread; this one (gRPC, model loading) on one, so that the
        # process holds one OpenMP team and its workers keep spin-waiting (target_service.engine_threads).
        config = replace(config, torch_threads=serve_on_this_thread())
    cache_root = Path(config.cache_dir) if config.cache_dir else default_cache_root()
    resolved = resolve_model(config.model)
    source = materialize(resolved, cache_root)
    # The GGUF file's tensor table, not the converted copy's: it tells whether the layers are blocks
    dtype = choose_model_dtype(config.dtype, config.device, resolved)
    log.info("target dtype %s (%s)", dtype.dtype, dtype.reason)
    model = load_model(source, device=config.device, dtype=dtype.dtype)
    fingerprint = vocab_fingerprint(load_tokenizer(source))
    verifier = Verifier.from_config(model, fingerprint, config, profile=False)
    log.info("engine step: %s (--compile %s)", verifier.step_form, config.compile)
    if config.profile_cost:
        size_budgets(verifier, kept_curve_path(cache_root, source.name, verifier, config))
    return verifier


def interceptors(config: VerifierConfig) -> list[grpc.ServerInterceptor]:
    """The internal token check, after the exposure rule (SystemExit with what to pass when it fails)."""
    token = internal_token(config, "verifier")
    return [InternalTokenInterceptor(token)] if token is not None else []


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_config(argv)
    setup_logging(log_level, "verifier")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers),
        options=server_options(),
        interceptors=[ErrorInterceptor(), *interceptors(config)],
    )
    metrics = VerifierMetrics()
    drain = Drain(config.shutdown_grace_s)
    servicer = VerifierServicer(metrics, drain=drain)
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
    health, address = listen(server, config, SERVICE_NAME, drain)
    track_watches(metrics.registry, health)
    server.start()
    drain_on_signals(drain)
    log.info("loading target model %s on %s", config.model, config.device)
    verifier = build_verifier(config)
    if drain.draining:
        server.stop(grace=0).wait()
        return
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    # Draining: Prefills of new sessions are refused; the server stops once it holds no session (in-flight
    # coordinator streams Verify and Release theirs) or the grace runs out.
    drain.count_busy(lambda: verifier.num_active_sessions)
    servicer.attach(verifier)
    mark_serving(health, [SERVICE_NAME])
    print(
        f"verifier listening on {address} (model {config.model}, {verifier.dtype}, "
        f"KV cache {config.kv_cache_gib:g} GiB, vocab {verifier.vocab_fingerprint})",
        flush=True,
    )
    stop_when_drained(server, drain)
