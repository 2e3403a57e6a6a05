"""Entry point of the coordinator: ``python -m coordinator``."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator import request_log
from coordinator.admission import AdmissionController
from coordinator.config import (
    CoordinatorConfig,
    admission_limits,
    grpc_call_backstop,
    http_connection_backstop,
    internal_tls,
    max_concurrent_calls,
    max_receive_message_bytes,
    prompt_limits,
    round_policy,
    tokenize_queue,
)
from coordinator.constraints.compiler import GrammarCompiler
from coordinator.discovery import (
    TargetError,
    WatchedReplicas,
    is_k8s_target,
    parse_target,
)
from coordinator.drafter_health import HealthCheckedDrafter
from coordinator.drafter_pool import DrafterPool
from coordinator.frontend import GenerationBackend, GenerationFrontend
from coordinator.grpc_clients import GrpcDrafter, GrpcVerifier
from coordinator.k8s_watch import ApiServerError, EndpointSliceWatch, api_client_from_environment, own_zone
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_api.app import create_app
from coordinator.openai_api.serve import HttpServer, HttpStartError
from coordinator.ports import DrafterPort, VerifierInfo, VerifierPort
from coordinator.rounds import Generation, GenerationRequest
from coordinator.server import GenerationServicer
from coordinator.verifier_router import StickyVerifierRouter, replica_resolver
from specserve.auth.interceptors import ApiKeyInterceptor
from specserve.auth.internal import InternalCredentials, Metadata, read_token
from specserve.auth.keys import ApiKeys, KeyFileError
from specserve.auth.tls import ExposureError, aio_channel, check_exposure
from specserve.call_limit import AioCallLimitInterceptor, CallLimit
from specserve.drain import Drain
from specserve.errors import DrafterFailed
from specserve.health import track_watches
from specserve.lifecycle import listen
from specserve.model_loading import (
    default_cache_root,
    eos_token_ids,
    load_tokenizer_without_torch,
    resolve_model,
    vocab_fingerprint,
)
from specserve.rpc import (
    channel_options,
    mark_serving,
    reconnect_options,
    serve_until_signal,
    server_options,
)
from specserve.rpc_errors import AioErrorInterceptor
from specserve.service_main import parse_service_config, setup_logging
from specserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("coordinator")

DRAFTER_START_WAIT_S = 10.0
"""How long start-up waits for a drafter given by address to answer before going on without it."""
SELF_SERVICE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z]([-a-z0-9]*[a-z0-9])?$")
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class StartupError(RuntimeError):
    """The coordinator cannot serve with the configured workers; the message says why."""


def parse_config(argv: list[str] | None = None) -> tuple[CoordinatorConfig, str]:
    """The coordinator's config from its command line and environment (``CoordinatorConfig`` declares both)."""
    return parse_service_config(
        CoordinatorConfig, argv, prog="coordinator", description="specserve coordinator (public API)", refine=refine
    )


def refine(config: CoordinatorConfig) -> CoordinatorConfig:
    """The tier targets and --self-service read as they will be used (ValueError naming the flag)."""
    for flag, target in (("--verifier", config.verifier), ("--drafter", config.drafter or "")):
        if is_k8s_target(target):
            try:
                parse_target(target)
            except TargetError as exc:
                raise ValueError(f"{flag}: {exc}") from exc
    if config.self_service and not SELF_SERVICE.match(config.self_service):
        raise ValueError(f"--self-service {config.self_service!r}: expected NAMESPACE/SERVICE")
    return config


async def wait_until_serving(channel: grpc.aio.Channel, target: str, timeout_s: float) -> None:
    """Wait for a worker's health service to report SERVING (its model has loaded)."""
    stub = health_pb2_grpc.HealthStub(channel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if loop.time() > deadline:
            raise StartupError(f"the verifier at {target} did not become ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


def internal_channel(
    config: CoordinatorConfig, address: str, tier: str, extra_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to a worker at ``address`` of ``tier`` (a --verifier/--drafter target), TLS when configured.

    A replica of a ``dns:///name:port`` tier is dialled by IP: its certificate is checked against ``name``
    (for a ``k8s://`` tier, against the Service's ``<service>.<namespace>.svc``).
    """
    options = [*channel_options(), *extra_options]
    tls = internal_tls(config)
    if tls is not None and tier.startswith("dns:///") and address != tier:
        options.append(("grpc.ssl_target_name_override", tier.removeprefix("dns:///").rsplit(":", 1)[0]))
    elif tls is not None and is_k8s_target(tier):
        # A watched endpoint is dialled by IP: its certificate is checked against <service>.<namespace>.svc.
        target = parse_target(tier)
        options.append(("grpc.ssl_target_name_override", f"{target.service}.{target.namespace}.svc"))
    return aio_channel(address, tls, options)


def internal_metadata(config: CoordinatorConfig) -> Callable[[], Metadata]:
    """Metadata for each internal call: the internal token (when configured) and the request's tenant."""
    return InternalCredentials(config.security.internal_token()).metadata


class Watches:
    """The EndpointSlice watches of this coordinator's k8s:// targets (none for DNS names and address lists)."""

    def __init__(self, observer: CoordinatorMetrics) -> None:
        self._observer = observer
        self._api_client: Any = None
        self.started: list[EndpointSliceWatch] = []
        self.stopping = threading.Event()

    def api_client(self) -> Any:
        if self._api_client is None:
            try:
                self._api_client = api_client_from_environment()
            except ApiServerError as exc:
                raise StartupError(str(exc)) from exc
        return self._api_client

    def start(self, target: str, tier: str) -> EndpointSliceWatch:
        watch = EndpointSliceWatch(parse_target(target), tier, self.api_client(), observer=self._observer)
        watch.start()
        self.started.append(watch)
        return watch

    def stop(self) -> None:
        self.stopping.set()
        for watch in self.started:
            watch.stop()


async def wait_for_ready_endpoint(watch: EndpointSliceWatch, timeout_s: float) -> None:
    """Wait until the watch lists an accepting endpoint: it passed its readiness probe, so its model is loaded."""
    log.info("waiting for a ready %s endpoint of %s", watch.tier, watch.target)
    found = await asyncio.to_thread(watch.wait_for, lambda s: any(e.accepting for e in s.endpoints), timeout_s)
    if not found:
        snapshot = watch.snapshot
        seen = "the API server never answered" if not snapshot.synced else f"{len(snapshot.endpoints)} listed"
        raise StartupError(
            f"no ready {watch.tier} endpoint in {watch.target} within {timeout_s:.0f} s ({seen}): check the "
            f"Service's EndpointSlices (kubectl -n {watch.target.namespace} get endpointslices -l "
            f"{watch.target.label_selector}) and the coordinator's Role"
        )


async def connect_verifier(
    config: CoordinatorConfig, fingerprint: str, watches: Watches | None = None
) -> tuple[VerifierPort, VerifierInfo]:
    """The verifier tier (one or many replicas, with session affinity), checked for a matching vocabulary."""
    if is_k8s_target(config.verifier):
        return await _checked_verifier(config, fingerprint, await watched_verifier(config, watches))
    resolve = replica_resolver(config.verifier)
    # A dns:/// target is one gRPC target (round-robin over its pods); a comma-separated list is waited for
    # replica by replica, so no session is pinned to one still loading its model.
    targets = [config.verifier] if config.verifier.startswith("dns:///") else resolve()
    for target in targets:
        channel = internal_channel(config, target, config.verifier)
        log.info("waiting for the verifier at %s", target)
        await wait_until_serving(channel, target, config.startup_timeout_s)
        await channel.close()
    return await _checked_verifier(config, fingerprint, StickyVerifierRouter(resolve, verifier_connector(config)))


def verifier_connector(config: CoordinatorConfig) -> Callable[[str], GrpcVerifier]:
    metadata = internal_metadata(config)

    def connect(address: str) -> GrpcVerifier:
        return GrpcVerifier(
            internal_channel(config, address, config.verifier),
            address,
            config.verifier_timeout_s,
            metadata,
            stream=config.verify_transport == "stream",
        )

    return connect


async def watched_verifier(config: CoordinatorConfig, watches: Watches | None) -> StickyVerifierRouter:
    """A router over the verifier endpoints a watch lists, read at every call (no refresh period)."""
    if watches is None:
        raise StartupError(f"--verifier {config.verifier} needs the Kubernetes API, which this caller did not set up")
    watch = watches.start(config.verifier, "verifier")
    await wait_for_ready_endpoint(watch, config.startup_timeout_s)
    source = WatchedReplicas("verifier", lambda: watch.snapshot, watches._observer)
    return StickyVerifierRouter(source, verifier_connector(config), refresh_s=0.0, on_pin=source.pinned)


async def _checked_verifier(
    config: CoordinatorConfig, fingerprint: str, verifier: StickyVerifierRouter
) -> tuple[VerifierPort, VerifierInfo]:
    info = await verifier.info()
    if info.vocab_fingerprint != fingerprint:
        raise StartupError(
            f"the verifier at {config.verifier} serves {info.model_name!r} whose vocabulary "
            f"({info.vocab_fingerprint}) differs from this coordinator's tokenizer ({fingerprint}, "
            f"--model {config.model}): point both at the same model"
        )
    return verifier, info


async def connect_drafter(
    config: CoordinatorConfig, fingerprint: str, verifier: VerifierInfo, watches: Watches | None = None
) -> GrpcDrafter | DrafterPool | None:
    """The drafter tier, or None when unset or serving another vocabulary (drafting is optional)."""
    if config.drafter is None:
        return None

    def connect(address: str) -> GrpcDrafter:
        # Reconnects bounded by the circuit's first probe interval: a restarted drafter is used again at the next
        # probe.
        assert config.drafter is not None
        channel = internal_channel(config, address, config.drafter, reconnect_options(config.drafter_backoff_ms / 1000))
        return GrpcDrafter(channel, address, verifier.vocab_size, internal_metadata(config), verifier.verify_cost)

    drafter: GrpcDrafter | DrafterPool
    if is_k8s_target(config.drafter):
        if watches is None:
            raise StartupError(f"--drafter {config.drafter} needs the Kubernetes API, which this caller did not set up")
        watch = watches.start(config.drafter, "drafter")
        source = WatchedReplicas("drafter", lambda: watch.snapshot, watches._observer)
        drafter = DrafterPool(source, connect, zone=config.zone, on_pin=source.pinned)
        if not config.zone and config.self_service:
            learn_zone(config, watches, drafter)
        # Drafting is optional: wait briefly for the first list, then go on; drafters join as they turn ready.
        if not await asyncio.to_thread(watch.wait_for, lambda s: any(e.accepting for e in s.endpoints), 10.0):
            log.warning("no ready drafter endpoint in %s yet; requests decode without one until there is", watch.target)
            return drafter
    else:
        drafter = connect(config.drafter)
    try:
        # A drafter started beside this coordinator may still be loading: wait briefly for it, as for the first
        # list above, so the first requests do not find it unreachable and skip it for a backoff.
        info = await (drafter.info(DRAFTER_START_WAIT_S) if isinstance(drafter, GrpcDrafter) else drafter.info())
    except (grpc.aio.AioRpcError, DrafterFailed) as exc:
        log.warning(
            "drafter at %s not reachable yet (%s); requests decode without it until it is",
            config.drafter,
            exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc,
        )
        return drafter
    if info.vocab_fingerprint and info.vocab_fingerprint != fingerprint:
        log.error(
            "refusing the drafter at %s: its vocabulary (%s) differs from the target's (%s)",
            config.drafter,
            info.vocab_fingerprint,
            fingerprint,
        )
        return None
    return drafter


def learn_zone(config: CoordinatorConfig, watches: Watches, pool: DrafterPool) -> None:
    """Find this pod's zone in its own Service's EndpointSlices (in a thread, retried until it is listed).

    Pods cannot read their node's topology labels through the downward API, but the EndpointSlice controller
    copies the zone into each endpoint, and the coordinator's Role already allows reading EndpointSlices.
    """
    pod = os.environ.get("POD_NAME", "")
    namespace, _, service = config.self_service.partition("/")
    if not pod:
        log.warning("--self-service is set but POD_NAME is not: drafter sessions prefer no zone")
        return
    api_client = watches.api_client()

    def find() -> None:
        for _attempt in range(60):
            try:
                zone = own_zone(api_client, namespace, service, pod)
            except Exception as exc:  # the API server may be briefly away: try again
                log.debug("looking up this pod's zone: %s", exc)
                zone = None
            if zone is not None:
                pool.zone = zone
                log.info("this coordinator runs in zone %r: drafter endpoints there get its sessions first", zone)
                return
            if watches.stopping.wait(5.0):
                return
        log.warning("pod %s is not in the EndpointSlices of %s: drafter sessions prefer no zone", pod, service)

    threading.Thread(target=find, name="k8s-own-zone", daemon=True).start()


def health_checked(
    config: CoordinatorConfig, drafter: DrafterPort | None, metrics: CoordinatorMetrics
) -> HealthCheckedDrafter | None:
    """The drafter behind a circuit breaker and a latency-following timeout (see coordinator.drafter_health)."""
    if drafter is None:
        return None
    return HealthCheckedDrafter(
        drafter,
        config.drafter or "in-process",
        ceiling_s=config.draft_timeout_ms / 1000,
        floor_s=config.draft_timeout_floor_ms / 1000,
        backoff_s=config.drafter_backoff_ms / 1000,
        max_backoff_s=config.drafter_max_backoff_ms / 1000,
        on_failure=metrics.drafter_failed,
        on_circuit=metrics.drafter_circuit.set,
    )


def add_reflection(server: grpc.aio.Server) -> None:
    """gRPC server reflection, so grpcurl and buf curl find the services without the .proto files.

    Reflection answers with the schema only, but it sits behind the API key like every call except health:
    a caller without a key learns nothing about the server (send the key with ``grpcurl -H``).
    """
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)


def api_keys(config: CoordinatorConfig) -> ApiKeys | None:
    """The API keys callers must present, after the exposure rule: None (no auth) only on loopback or --insecure."""
    check_exposure(
        "coordinator",
        config.host,
        authenticated=config.api_keys_file is not None,
        insecure=config.security.insecure,
        how="--api-keys-file (SPECSERVE_API_KEYS_FILE) with the digests of the callers' keys",
        tls=config.security.tls.enabled,
    )
    if config.api_keys_file is None:
        log.warning("authentication is off: anyone who reaches %s:%d may generate", config.host, config.port)
        return None
    return ApiKeys(Path(config.api_keys_file), config.api_keys_reload_s)


async def start_http(
    config: CoordinatorConfig, frontend: GenerationFrontend, keys: ApiKeys | None, drain: Drain, call_limit: CallLimit
) -> HttpServer | None:
    """The OpenAI-compatible HTTP API on --host:--http-port, with the gRPC port's TLS, keys and drain (None: off).

    It listens before the workers are connected: /health says 503 until the coordinator serves. The exposure
    rule checked for --host in ``api_keys`` covers this port too.
    """
    if not config.http_port:
        return None
    app = create_app(frontend, keys, drain, config.max_prompt_bytes, call_limit=call_limit)
    http = HttpServer(app, config.host, config.http_port, config.security.tls, http_connection_backstop(config))
    try:
        await http.start()
    except HttpStartError as exc:
        raise StartupError(str(exc)) from exc
    return http


async def serve(config: CoordinatorConfig) -> None:
    try:
        keys = api_keys(config)
        internal_metadata(config)  # the token file is readable and not empty
        metrics_token = (
            read_token(config.metrics_token_file, "--metrics-token-file") if config.metrics_token_file else None
        )
    except (ExposureError, KeyFileError, ValueError) as exc:
        raise StartupError(str(exc)) from exc
    metrics = CoordinatorMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host, metrics_token)
    admission = AdmissionController(admission_limits(config), metrics)
    metrics.track_admission(admission)

    def call_limit(server: str) -> CallLimit:
        return CallLimit(
            max_concurrent_calls(config), server, admission.retry_after_s, lambda: metrics.rejected("call_limit")
        )

    # Errors are mapped outermost, so a refused key or call is as clean a status as anything else. The call limit
    # answers before gRPC's own maximum_concurrent_rpcs (a backstop above it) would, in its library words.
    interceptors: list[grpc.aio.ServerInterceptor] = [
        AioErrorInterceptor(),
        AioCallLimitInterceptor(call_limit("coordinator")),
    ]
    interceptors += [ApiKeyInterceptor(keys)] if keys is not None else []
    options = [*server_options(), ("grpc.max_receive_message_length", max_receive_message_bytes(config))]
    server = grpc.aio.server(
        options=options, interceptors=interceptors, maximum_concurrent_rpcs=grpc_call_backstop(config)
    )
    # On SIGTERM (specserve.drain): health NOT_SERVING, new and queued streams refused, running ones finish.
    drain = Drain(config.shutdown_grace_s)
    drain.count_busy(lambda: admission.running)
    drain.on_begin(admission.drain)
    frontend = GenerationFrontend(config.served_model_name or config.model, admission, metrics)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(frontend), server)
    health, address = listen(server, config, SERVICE_NAME, drain)
    track_watches(metrics.registry, health)
    add_reflection(server)
    await server.start()
    http = await start_http(
        config, frontend, keys, drain, call_limit("coordinator's HTTP API")
    )  # /health: 503 until the workers are connected
    cache_root = Path(config.cache_dir) if config.cache_dir else default_cache_root()
    source, tokenizer = await asyncio.to_thread(load_tokenizer_without_torch, resolve_model(config.model), cache_root)
    watches = Watches(metrics)  # k8s:// targets: daemon threads, stopped once the drain is over
    fingerprint = vocab_fingerprint(tokenizer)
    verifier, info = await connect_verifier(config, fingerprint, watches)
    drafter = health_checked(config, await connect_drafter(config, fingerprint, info, watches), metrics)
    eos = eos_token_ids(source, tokenizer)
    policy = round_policy(config, info)

    def new_generation(request: GenerationRequest) -> Generation:
        return Generation(request, verifier, drafter, tokenizer, eos, fingerprint, policy, drafter_monitor=drafter)

    limits = prompt_limits(config, info)
    constraints = GrammarCompiler(tokenizer, info.vocab_size, eos, fingerprint, observer=metrics)
    frontend.attach(GenerationBackend(tokenizer, limits, new_generation, tokenize_queue(config), constraints))
    mark_serving(health, [SERVICE_NAME])
    auth = "API keys" if keys is not None else "auth off"
    tls = "TLS" if config.security.tls.enabled else "plaintext"
    where = address if http is None else f"{address} and {http.scheme}://{config.host}:{http.port}/v1"
    print(
        f"coordinator listening on {where} ({auth}, {tls}; verifier {config.verifier}, drafter {config.drafter})",
        flush=True,
    )
    await serve_until_signal(server, drain)
    watches.stop()
    if http is not None:  # after the drain: its streams have finished, new requests got 503 meanwhile
        await http.stop(now=drain.forced)


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_config(argv)
    setup_logging(log_level, "coordinator")
    request_log.configure()
    try:
        asyncio.run(serve(config))
    except StartupError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from exc
