"""Entry point of the verifier: ``python -m target_service``."""

from __future__ import annotations

import argparse
import hashlib
import logging
from concurrent import futures
from dataclasses import fields, replace
from pathlib import Path

import grpc

from specserve.auth.config import security_from_args
from specserve.auth.interceptors import InternalTokenInterceptor
from specserve.auth.tls import ExposureError, add_port
from specserve.block_weights import choose_model_dtype
from specserve.drain import Drain
from specserve.health import track_watches
from specserve.model_loading import (
    default_cache_root,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)
from specserve.rpc import add_health, drain_on_signals, mark_draining, mark_serving, server_options, stop_when_drained
from specserve.rpc_errors import ErrorInterceptor
from specserve.service_main import add_common_flags, env, setup_logging
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from target_service.config import VerifierConfig
from target_service.draft_budget import CostCurve
from target_service.metrics import VerifierMetrics
from target_service.model_runner import COMPILE_CHOICES, WEIGHTS_CHOICES
from target_service.server import VerifierServicer
from target_service.verifier import Verifier

log = logging.getLogger("target_service")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


def parse_config(argv: list[str] | None = None) -> tuple[VerifierConfig, str]:
    defaults = VerifierConfig()
    parser = argparse.ArgumentParser(prog="target_service", description="specserve verifier (target model)")
    add_common_flags(parser, defaults)
    parser.add_argument(
        "--model",
        default=env("SPECSERVE_MODEL", defaults.model),
        help="'smollm2' (packaged GGUF), a .gguf file or a Hugging Face model directory",
    )
    parser.add_argument("--device", default=env("SPECSERVE_DEVICE", defaults.device), help="cpu, cuda, cuda:1 ...")
    parser.add_argument(
        "--dtype",
        default=env("SPECSERVE_DTYPE", defaults.dtype),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the target's layers; auto: bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32, "
        "and fp32 on any CPU for a GGUF model of Q4_1/Q8_0 blocks (acceptance always reads fp32 logits)",
    )
    parser.add_argument(
        "--cache-dir",
        default=env("SPECSERVE_CACHE_DIR", ""),
        help="where GGUF models are converted once (default ~/.cache/specserve)",
    )
    parser.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    parser.add_argument("--session-ttl-s", type=float, default=defaults.session_ttl_s)
    parser.add_argument("--max-tree-nodes", type=int, default=defaults.max_tree_nodes)
    parser.add_argument("--max-tree-depth", type=int, default=defaults.max_tree_depth)
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=defaults.max_session_tokens,
        help="context limit per session (0: the model's)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=defaults.kv_cache_gib,
        help="preallocated KV cache for all sessions; prefills wait for room, then get RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="tokens scored in one engine step across sessions (long prefills are chunked to fit)",
    )
    parser.add_argument("--max-batch-sessions", type=int, default=defaults.max_batch_sessions)
    parser.add_argument("--admission-timeout-s", type=float, default=defaults.admission_timeout_s)
    parser.add_argument("--evict-idle-s", type=float, default=defaults.evict_idle_s)
    parser.add_argument(
        "--no-profile-cost",
        dest="profile_cost",
        action="store_false",
        help="skip measuring the cost curve at start-up (draft budgets then follow the tree limits only)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default=env("SPECSERVE_COMPILE", defaults.compile),
        help="auto: the step's weights prepacked for the CPU's GEMM kernels at static row counts (a verify of "
        "2-8 rows then costs about one row); off: eager F.linear, for debugging and comparison; inductor (CPU, "
        "opt-in): the whole step compiled as one graph by torch.compile at every start-up (90-130 s on 2 cores); "
        "use with --dedicated-cores",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default=env("SPECSERVE_WEIGHTS", defaults.weights),
        help="dtype: the layers read the model's weights in --dtype; int8: int8 copies of them (per-channel "
        "scales, bf16 activations in the products; CPU with --compile auto): a quarter of fp32's bytes, other "
        "weights, so other output than --dtype alone gives; speculation then does not reproduce plain int8 decoding "
        "token for token (docs/numerics.md)",
    )
    parser.add_argument(
        "--no-throughput-guard",
        dest="throughput_guard",
        action="store_false",
        help="size draft budgets by the cost curve alone, without checking them against measured throughput",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=int(env("SPECSERVE_TORCH_THREADS", str(defaults.torch_threads)))
    )
    parser.add_argument(
        "--dedicated-cores",
        action=argparse.BooleanOptionalAction,
        default=env("SPECSERVE_DEDICATED_CORES", "1" if defaults.dedicated_cores else "0") not in ("0", "", "false"),
        help="on by default: the gRPC thread runs torch on one thread and the engine thread on all, so the process "
        "holds one OpenMP team whose workers spin-wait between regions (with two, libgomp puts them to sleep and "
        "every parallel region waits for a wake-up); --no-dedicated-cores keeps torch's threads on both",
    )
    parser.add_argument("--max-workers", type=int, default=defaults.max_workers)
    args = parser.parse_args(argv)
    if args.weights == "int8" and (args.compile != "auto" or not args.device.startswith("cpu")):
        parser.error("--weights int8 runs on the CPU's packed kernels: use it with --device cpu and --compile auto")
    if args.compile == "inductor" and not args.device.startswith("cpu"):
        parser.error("--compile inductor compiles the CPU's step: on a GPU, --compile auto captures CUDA graphs")
    try:
        args.security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    values = {f.name: getattr(args, f.name) for f in fields(VerifierConfig)}
    values["cache_dir"] = values["cache_dir"] or None
    return VerifierConfig(**values), args.log_level


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
        _size_budgets(verifier, cache_root / "cost-curves" / f"{_curve_key(source.name, verifier, config)}.json")
    return verifier


def _curve_key(model_name: str, verifier: Verifier, config: VerifierConfig) -> str:
    """What the cost curve depends on: model, dtype, device, CPU and threads, the batch budget, the step's form."""
    import torch

    from specserve.hardware import cpu_model

    parts = [model_name, verifier.dtype, str(verifier.device), cpu_model(), str(torch.get_num_threads())]
    parts += [str(config.max_batch_tokens), verifier.step_form]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _size_budgets(verifier: Verifier, cached: Path) -> None:
    """Use the cost curve measured on an earlier start on this machine, else measure it (seconds) and keep it."""
    try:
        verifier.use_cost_curve(CostCurve.from_json(cached.read_text()))
        log.info("cost curve from %s (delete it to measure again)", cached)
        return
    except (OSError, ValueError):
        pass
    log.info("measuring the engine's cost curve (once per machine, model and dtype)")
    curve = verifier.profile_cost()
    if not curve.plausible():
        log.warning("the cost curve looks stalled (another process held the cores?): used now, not kept")
        return
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(curve.to_json())
    except OSError as exc:
        log.warning("could not keep the cost curve in %s: %s", cached, exc)


def interceptors(config: VerifierConfig) -> list[grpc.ServerInterceptor]:
    """The internal token check, after the exposure rule (SystemExit with what to pass when it fails)."""
    try:
        config.security.check_internal_exposure("verifier", config.host)
        token = config.security.internal_token()
    except (ExposureError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
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
    health = add_health(server, [SERVICE_NAME], config.max_health_watches)
    track_watches(metrics.registry, health)
    address = f"{config.host}:{config.port}"
    add_port(server, address, config.security.tls)
    server.start()
    drain.on_begin(lambda: mark_draining(health))
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
