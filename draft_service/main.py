"""Entry point of the drafter: ``python -m draft_service``."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import torch

from draft_service.config import POOL_SHARE, DrafterConfig
from draft_service.draft_head import DraftHeadError, in_serving_dtype, load_draft_head, require_weights
from draft_service.draft_lm import DraftLM, DraftLMError, load_draft_lm
from draft_service.draft_lm_source import DraftLMProposer
from draft_service.drafter import Drafter
from draft_service.eagle3_head import Eagle3Head, eagle3_in_serving_dtype, is_eagle3_dir, load_eagle3_head
from draft_service.head_proposer import HeadProposer, TreeShape
from draft_service.head_types import ServingHead
from draft_service.metrics import DrafterMetrics
from draft_service.ngram_pool import PoolShape
from draft_service.pools import PoolRegistry
from draft_service.proposers import PromptLookupProposer
from draft_service.server import DrafterServicer
from draft_service.session_memory import SessionMemory
from specserve.auth.interceptors import AioInternalTokenInterceptor
from specserve.drain import Drain
from specserve.health import track_watches
from specserve.lifecycle import internal_token, listen
from specserve.model_loading import (
    ModelNotFoundError,
    default_cache_root,
    load_model,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)
from specserve.rpc import mark_serving, serve_until_signal, server_options
from specserve.rpc_errors import AioErrorInterceptor
from specserve.service_main import parse_service_config, setup_logging
from specserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("draft_service")
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


def parse_config(argv: list[str] | None = None) -> tuple[DrafterConfig, str]:
    """The drafter's config from its command line and environment (``DrafterConfig`` declares both)."""
    return parse_service_config(
        DrafterConfig, argv, prog="draft_service", description="specserve drafter", refine=refine
    )


def refine(config: DrafterConfig) -> DrafterConfig:
    """``--device`` checked against what this process can use, and written as torch writes it; the sources
    with the draft model's (``with_draft_lm``)."""
    config = replace(config, device=str(drafter_device(config.device)))
    return replace(config, sources=with_draft_lm(config.sources, config.draft_model))


def with_draft_lm(sources: tuple[str, ...], draft_model: str) -> tuple[str, ...]:
    """``sources`` with draft_lm after them when ``--draft-model`` is set; ValueError when draft_lm is named
    without a draft model.

    A draft model given is meant to draft, whatever ``--sources`` lists (its default names the n-gram sources
    and the draft head): making the user also add it there would leave a model loaded for nothing.
    """
    if not draft_model:
        if DraftLMProposer.name in sources:
            raise ValueError(f"the {DraftLMProposer.name} source needs a draft model: pass --draft-model PATH")
        return sources
    return sources if DraftLMProposer.name in sources else (*sources, DraftLMProposer.name)


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


def build_drafter(
    config: DrafterConfig, head: ServingHead | None = None, draft_lm: DraftLM | None = None
) -> tuple[Drafter, PoolRegistry]:
    """The drafter ``config`` describes; the draft_model source needs ``head`` (see ``load_head``), the draft_lm
    source ``draft_lm`` (``load_draft_model``)."""
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
        draft_lm=draft_lm,
        lookahead_pool_for=pools.lookahead,
    )
    return drafter, pools


def load_draft_model(config: DrafterConfig) -> DraftLM:
    """The draft model of ``--draft-model`` on ``--device``, checked to share ``--target-model``'s tokenizer.

    Raises DraftLMError (no model at the path, weights that do not load, another family or tokenizer) with a
    message that names both models and says what to do.
    """
    try:
        target = materialize(resolve_model(config.target_model), default_cache_root())
    except ModelNotFoundError as exc:
        raise DraftLMError(f"--target-model {config.target_model!r}: {exc}") from exc
    fingerprint = vocab_fingerprint(load_tokenizer(target))
    model = load_draft_lm(config.draft_model, fingerprint, config.target_model, config.device)
    log.info("draft model %s (the %s source): %s", config.draft_model, DraftLMProposer.name, model.describe())
    return model


def load_head(config: DrafterConfig) -> ServingHead:
    """The draft head over the target's embedding and LM head (its ``target_fingerprint`` is the target's): our
    own head file, or a published EAGLE-3 head's directory (``eagle3_head``).

    Raises DraftHeadError (missing, corrupt or foreign weights) with a message that says what to do.
    """
    path = Path(config.draft_head_path)
    if not is_eagle3_dir(path):
        require_weights(path)
    source = materialize(resolve_model(config.target_model), default_cache_root())
    fingerprint = vocab_fingerprint(load_tokenizer(source))
    target = load_model(source)
    embedding = target.get_input_embeddings().weight.detach()
    if is_eagle3_dir(path):
        return load_eagle3(config, path, fingerprint, embedding, int(target.config.num_hidden_layers))
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


def load_eagle3(
    config: DrafterConfig, path: Path, fingerprint: str, embedding: torch.Tensor, target_layers: int
) -> Eagle3Head:
    """The EAGLE-3 head in ``path`` for this target, on ``--device`` in ``--head-dtype``."""
    head = load_eagle3_head(path, target_fingerprint=fingerprint, embedding=embedding, target_layers=target_layers)
    head, dtype = eagle3_in_serving_dtype(head, config.head_dtype, config.device)
    log.info(
        "EAGLE-3 head %s runs on %s in %s (%s), reading the target's layers %s; its products: %s",
        path,
        config.device,
        dtype.dtype,
        dtype.reason,
        list(head.feature_layers),
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
    token = internal_token(config, "drafter")
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
    draft_lm = None
    if DraftLMProposer.name in config.sources:
        try:
            draft_lm = load_draft_model(config)
        except DraftLMError as exc:
            raise SystemExit(f"drafter: cannot use the {DraftLMProposer.name} source: {exc}") from exc
    drafter, pools = build_drafter(config, head, draft_lm)
    server = grpc.aio.server(options=drafter_server_options(config), interceptors=[AioErrorInterceptor(), *checks])
    drain = Drain(config.shutdown_grace_s)
    servicer = DrafterServicer(drafter, pools, drain, config.stream_idle_timeout_s)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
    health, address = listen(server, config, SERVICE_NAME, drain)
    await server.start()
    mark_serving(health, [SERVICE_NAME])
    if config.metrics_port:
        metrics = DrafterMetrics(drafter.memory, pools, drafter.predraft_counts, drafter.gate_counts)
        servicer.observe_propose = metrics.observe_propose
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
