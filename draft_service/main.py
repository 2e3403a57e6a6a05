"""Entry point of the drafter: ``python -m draft_service``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

import grpc
import torch

from draft_service.config import POOL_SHARE, DrafterConfig
from draft_service.draft_head import DraftHead, DraftHeadError, in_serving_dtype, load_draft_head, require_weights
from draft_service.drafter import ALL_SOURCES, Drafter
from draft_service.head_products import HEAD_MATMUL_CHOICES
from draft_service.head_proposer import HeadProposer, TreeShape
from draft_service.metrics import DrafterMetrics
from draft_service.ngram_pool import PoolShape
from draft_service.pools import PoolRegistry
from draft_service.proposers import PromptLookupProposer
from draft_service.server import DrafterServicer
from draft_service.session_memory import SessionMemory
from specserve.auth.config import security_from_args
from specserve.auth.interceptors import AioInternalTokenInterceptor
from specserve.auth.tls import ExposureError, add_port
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
from specserve.rpc import add_health, mark_draining, mark_serving, serve_until_signal, server_options
from specserve.rpc_errors import AioErrorInterceptor
from specserve.service_main import add_common_flags, env, setup_logging
from specserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("draft_service")
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


def parse_config(argv: list[str] | None = None) -> tuple[DrafterConfig, str]:
    defaults = DrafterConfig()
    parser = argparse.ArgumentParser(prog="draft_service", description="specserve drafter")
    add_common_flags(parser, defaults)
    parser.add_argument(
        "--redis-url",
        default=env("SPECSERVE_REDIS_URL", ""),
        help="shared n-gram pool, e.g. redis://127.0.0.1:6379/0 (default: in-memory pool)",
    )
    parser.add_argument("--redis-timeout-ms", type=int, default=defaults.redis_timeout_ms)
    parser.add_argument("--pool-key-len", type=int, default=defaults.pool_key_len)
    parser.add_argument("--pool-continuation-len", type=int, default=defaults.pool_continuation_len)
    parser.add_argument("--pool-max-keys", type=int, default=defaults.pool_max_keys)
    parser.add_argument("--lookup-min-ngram", type=int, default=defaults.lookup_min_ngram)
    parser.add_argument("--lookup-max-ngram", type=int, default=defaults.lookup_max_ngram)
    parser.add_argument(
        "--sources",
        default=env("SPECSERVE_DRAFT_SOURCES", ",".join(defaults.sources)),
        help=f"comma-separated draft sources, from {', '.join(ALL_SOURCES)}",
    )
    parser.add_argument(
        "--draft-head-path",
        default=env("SPECSERVE_DRAFT_HEAD", defaults.draft_head_path),
        help="weights of the draft head (the draft_model source)",
    )
    parser.add_argument(
        "--target-model",
        default=env("SPECSERVE_MODEL", defaults.target_model),
        help="the target the head was trained for (its embedding and LM head are loaded)",
    )
    parser.add_argument(
        "--device",
        default=env("SPECSERVE_DRAFTER_DEVICE", defaults.device),
        help="where the draft head, its per-session state and its tree expansion run: cpu, cuda or cuda:N "
        "(the n-gram sources run on the host either way)",
    )
    parser.add_argument(
        "--head-dtype",
        default=env("SPECSERVE_HEAD_DTYPE", defaults.head_dtype),
        choices=["auto", "float32", "bfloat16"],
        help="the draft head's compute dtype (auto: bf16 where the CPU has AMX or AVX512-BF16, else fp32)",
    )
    parser.add_argument(
        "--head-matmul",
        "--head-logits-matmul",
        dest="head_logits_matmul",
        default=env("SPECSERVE_HEAD_LOGITS_MATMUL", defaults.head_logits_matmul),
        choices=HEAD_MATMUL_CHOICES,
        help="packed: the head's fc, layer linears and draft logits run on weights prepacked once at start-up "
        "for the CPU's GEMM kernel (oneDNN; MKL for fp32 on Intel), F.linear where the dtype has none; "
        "int8: int8 copies of those weights (CPU; a draft's numerics can cost acceptance, never exactness); "
        "blocks: an fp32 head's weights as Q8_0 blocks on the block kernel (the draft logits' rows are the GGUF "
        "target's own; the head's weights rounded to 8 bits), its norms, rotary and attention there too; "
        "auto: whichever of packed, int8 and blocks a draft step timed at start-up runs fastest (another than "
        "packed only if at least 10%% faster); linear: F.linear everywhere",
    )
    parser.add_argument("--tree-depth", type=int, default=defaults.tree_depth)
    parser.add_argument("--tree-branching", type=int, default=defaults.tree_branching)
    parser.add_argument("--tree-beam", type=int, default=defaults.tree_beam)
    parser.add_argument(
        "--torch-threads", type=int, default=int(env("SPECSERVE_TORCH_THREADS", str(defaults.torch_threads)))
    )
    parser.add_argument(
        "--predraft-outcomes",
        type=int,
        default=int(env("SPECSERVE_PREDRAFT_OUTCOMES", str(defaults.predraft_outcomes))),
        help="likeliest outcomes of each tree to draft the next round for while the verifier checks it (0: off)",
    )
    parser.add_argument(
        "--coupled-sampling",
        action=argparse.BooleanOptionalAction,
        default=env("SPECSERVE_COUPLED_SAMPLING", "on" if defaults.coupled_sampling else "off") != "off",
        help="for sampled requests, the draft head drafts with the target's keyed Gumbel noise, so its first "
        "candidate is the target's own token far more often (--no-coupled-sampling: its top-k, as for greedy)",
    )
    parser.add_argument(
        "--max-memory-mib",
        type=int,
        default=int(env("SPECSERVE_DRAFTER_MAX_MEMORY_MIB", str(defaults.max_memory_mib))),
        help=f"bound of the in-memory n-gram pools ({POOL_SHARE:.0%}% of it), per-session drafting state and the "
        "namespaces' successor tables and acceptance statistics; over it the least recently used sessions lose "
        "their draft-head state (they draft from n-grams) and namespaces their tables and statistics",
    )
    parser.add_argument(
        "--max-namespaces",
        type=int,
        default=defaults.max_namespaces,
        help="most (vocabulary, pool namespace) pairs whose in-memory n-gram pool, successor table and acceptance "
        "statistics are kept; beyond it the least recently used pair's are dropped",
    )
    parser.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        default=defaults.stream_idle_timeout_s,
        help="a Draft stream that sends nothing this long is closed (DEADLINE_EXCEEDED) and its state freed",
    )
    parser.add_argument(
        "--max-connection-age-s",
        type=float,
        default=defaults.max_connection_age_s,
        help="clients reconnect after this long (open streams finish first), and so resolve the drafter "
        "Service's DNS name again: new drafter pods get sessions within about this long",
    )
    args = parser.parse_args(argv)
    try:
        args.security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    values = {f.name: getattr(args, f.name) for f in fields(DrafterConfig)}
    values["redis_url"] = values["redis_url"] or None
    values["sources"] = tuple(name.strip() for name in args.sources.split(",") if name.strip())
    unknown = set(values["sources"]) - set(ALL_SOURCES)
    if unknown:
        parser.error(f"unknown draft sources {sorted(unknown)}; choose from {', '.join(ALL_SOURCES)}")
    try:
        values["device"] = str(drafter_device(values["device"]))
    except ValueError as exc:
        parser.error(str(exc))
    if values["max_namespaces"] < 1:
        parser.error("--max-namespaces must be at least 1")
    return DrafterConfig(**values), args.log_level


def drafter_device(name: str) -> torch.device:
    """``--device`` as a torch device this process can use; ValueError saying what to pass instead."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a device: pass cpu, cuda or cuda:N") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: the drafter runs on cpu or cuda devices only")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this process sees no CUDA device; pass --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {name}: this process sees {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def build_drafter(config: DrafterConfig, head: DraftHead | None = None) -> tuple[Drafter, PoolRegistry]:
    """The drafter ``config`` describes; the draft_model source needs ``head`` (see ``load_head``)."""
    shape = PoolShape(key_len=config.pool_key_len, continuation_len=config.pool_continuation_len)
    memory_bytes = config.max_memory_mib << 20
    pool_bytes = int(memory_bytes * POOL_SHARE)
    pools = PoolRegistry(
        shape,
        config.redis_url,
        config.redis_timeout_ms / 1000,
        config.pool_max_keys,
        pool_bytes,
        max_pools=config.max_namespaces,
    )
    lookup = PromptLookupProposer(config.lookup_min_ngram, config.lookup_max_ngram)
    tree = TreeShape(config.tree_depth, config.tree_branching, config.tree_beam)
    drafter = Drafter(
        pools,
        lookup,
        sources=config.sources,
        draft_head=head,
        tree_shape=tree,
        predraft_outcomes=config.predraft_outcomes,
        coupled_sampling=config.coupled_sampling,
        memory=SessionMemory(memory_bytes - pool_bytes),
        max_namespaces=config.max_namespaces,
    )
    return drafter, pools


def load_head(config: DrafterConfig) -> DraftHead:
    """The draft head over the target's embedding and LM head (its ``target_fingerprint`` is the target's).

    Raises DraftHeadError (missing, corrupt or foreign weights) with a message that says what to do.
    """
    require_weights(Path(config.draft_head_path))
    source = materialize(resolve_model(config.target_model), default_cache_root())
    fingerprint = vocab_fingerprint(load_tokenizer(source))
    target = load_model(source)
    embedding = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    head, _ = load_draft_head(
        Path(config.draft_head_path), target_fingerprint=fingerprint, embedding=embedding, lm_head=lm_head
    )
    head, dtype = in_serving_dtype(head, config.head_dtype, config.head_logits_matmul, config.device)
    log.info(
        "draft head %s runs on %s in %s (%s); its products: %s",
        config.draft_head_path,
        config.device,
        dtype.dtype,
        dtype.reason,
        head.products,
    )
    return head


def drafter_server_options(config: DrafterConfig) -> list[tuple[str, Any]]:
    """The shared server options, plus a connection age limit.

    gRPC clients resolve a dns:/// target again only when a connection ends, never on a timer: without an age
    limit a coordinator would keep its Draft streams on the drafter pods it first found, and pods added by a
    scale-up would get no sessions. The grace is unlimited (gRPC's default), so open Draft streams finish.
    """
    return [*server_options(), ("grpc.max_connection_age_ms", round(config.max_connection_age_s * 1000))]


def interceptors(config: DrafterConfig) -> list[grpc.aio.ServerInterceptor]:
    """The internal token check, after the exposure rule (SystemExit with what to pass when it fails)."""
    try:
        config.security.check_internal_exposure("drafter", config.host)
        token = config.security.internal_token()
    except (ExposureError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
    return [AioInternalTokenInterceptor(token)] if token is not None else []


async def serve(config: DrafterConfig) -> None:
    checks = interceptors(config)
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    head = None
    if HeadProposer.name in config.sources:
        try:
            head = load_head(config)
        except DraftHeadError as exc:
            raise SystemExit(f"drafter: cannot use the {HeadProposer.name} source: {exc}") from exc
    drafter, pools = build_drafter(config, head)
    server = grpc.aio.server(options=drafter_server_options(config), interceptors=[AioErrorInterceptor(), *checks])
    drain = Drain(config.shutdown_grace_s)
    servicer = DrafterServicer(drafter, pools, drain, config.stream_idle_timeout_s)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    health = add_health(server, [SERVICE_NAME], config.max_health_watches)
    drain.on_begin(lambda: mark_draining(health))
    address = f"{config.host}:{config.port}"
    add_port(server, address, config.security.tls)
    await server.start()
    mark_serving(health, [SERVICE_NAME])
    if config.metrics_port:
        metrics = DrafterMetrics(drafter.memory, pools, drafter.predraft_counts, drafter.gate_counts)
        track_watches(metrics.registry, health)
        metrics.serve(config.metrics_port, config.host)
    print(f"drafter listening on {address} (n-gram pool: {pools.backend})", flush=True)
    try:
        await serve_until_signal(server, drain)
    finally:
        servicer.close()


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_config(argv)
    setup_logging(log_level, "drafter")
    asyncio.run(serve(config))
