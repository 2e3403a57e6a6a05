"""The coordinator's configuration, parsed once in main.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.admission import AdmissionLimits
from coordinator.ports import VerifierInfo
from coordinator.prompts import PromptLimits
from coordinator.rounds import RoundPolicy
from coordinator.tree_checks import TreeLimits
from specserve.auth.config import ServerSecurity
from specserve.auth.tls import ClientTLS
from specserve.drain import DEFAULT_GRACE_S
from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import (
    COORDINATOR_PORT,
    DEFAULT_MAX_HEALTH_WATCHES,
    DRAFTER_PORT,
    HTTP_PORT,
    LOOPBACK,
    VERIFIER_PORT,
)


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = LOOPBACK
    port: int = COORDINATOR_PORT
    http_port: int = HTTP_PORT  # the OpenAI-compatible HTTP API (coordinator.openai_api) on --host; 0: off
    # gRPC target: an address list, dns:///specserve-verifier:50053, or k8s://NAMESPACE/SERVICE:PORT (watched
    # through the Kubernetes API, coordinator.discovery)
    verifier: str = f"{LOOPBACK}:{VERIFIER_PORT}"
    drafter: str | None = f"{LOOPBACK}:{DRAFTER_PORT}"  # the same forms; None: verifier-only decoding
    # The coordinator's own zone, preferred for drafter sessions with a k8s:// drafter target; "" with
    # self_service set: learnt from this pod's (POD_NAME) entry in that Service's EndpointSlices.
    zone: str = ""
    self_service: str = ""  # NAMESPACE/SERVICE of the coordinator's own Service; "": no zone lookup
    model: str = DEFAULT_MODEL  # where the tokenizer and chat template come from
    served_model_name: str = ""  # the name clients use for the model (the HTTP API's `model`); empty: `model`
    cache_dir: str | None = None
    max_new_tokens_limit: int = 4096
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of a prompt, or of a chat's contents together
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    # The round loop's own defaults (coordinator.rounds.RoundPolicy), defined there once. Most draft tokens (tree
    # nodes) asked of the drafter per round; the target's likeliest next tokens per scored position (0: off).
    max_draft_tokens: int = RoundPolicy.max_draft_tokens
    num_successors: int = RoundPolicy.num_successors
    # Ceiling of the draft timeout; a slower drafter is dropped for the request.
    draft_timeout_ms: int = round(RoundPolicy.draft_timeout_s * 1000)
    draft_timeout_floor_ms: int = 100  # the timeout follows the drafter's p99 latency, never below this
    drafter_backoff_ms: int = 5000  # a failed drafter is skipped this long, doubling with each failure in a row
    drafter_max_backoff_ms: int = 60_000
    verifier_timeout_s: float = 120.0
    startup_timeout_s: float = 900.0  # how long to wait for the verifier to load its model
    metrics_port: int = 0
    metrics_token_file: str | None = None  # /metrics asks for this bearer token; None: open
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS; internal token it sends
    api_keys_file: str | None = None  # None: no authentication (loopback only, or --insecure)
    api_keys_reload_s: float = 5.0  # how often the key file is checked for changes
    internal_tls_ca: str | None = None  # TLS towards the verifier and drafters (any of the three turns it on)
    internal_tls_cert: str | None = None  # the coordinator's client certificate for workers that require mTLS
    internal_tls_key: str | None = None
    # Admission (coordinator.admission): streams running at once; the default matches one verifier's engine
    # step (its --max-batch-sessions), the queue its --max-sessions.
    max_concurrent_streams: int = 64
    max_queued_streams: int = 256  # streams waiting for a slot; more are refused with RESOURCE_EXHAUSTED
    queue_timeout_s: float = 30.0  # a queued stream waits this long for a slot, then RESOURCE_EXHAUSTED
    # Per tenant, unless its own setting says otherwise; 0: no limit. None: half the slots with API keys on (one
    # tenant cannot take every slot and queue place), no limit with them off (every caller is one tenant).
    tenant_max_concurrent_streams: int | None = None
    # Prompts waiting for one of the 2 tokenizer threads; more: RESOURCE_EXHAUSTED. 0: max_concurrent_streams, which
    # bounds it already (a prompt is tokenized only once its request holds a slot): a smaller queue refused a burst of
    # 64 streams that the slots admit (bench.load N=64: 46 of 64 refused at 16).
    max_tokenize_queue: int = 0
    shutdown_grace_s: float = DEFAULT_GRACE_S  # on SIGTERM, running streams get this long to finish
    max_health_watches: int = DEFAULT_MAX_HEALTH_WATCHES  # open Health/Watch streams; more: RESOURCE_EXHAUSTED


def internal_tls(config: CoordinatorConfig) -> ClientTLS | None:
    """TLS (and mTLS) towards the verifier and drafters, or None for plaintext."""
    if not (config.internal_tls_ca or config.internal_tls_cert or config.internal_tls_key):
        return None
    return ClientTLS(config.internal_tls_ca, config.internal_tls_cert, config.internal_tls_key)


def round_policy(config: CoordinatorConfig, verifier: VerifierInfo) -> RoundPolicy:
    """How rounds run, within what the verifier accepts."""
    return RoundPolicy(
        max_draft_tokens=min(config.max_draft_tokens, verifier.max_tree_nodes),
        draft_timeout_s=config.draft_timeout_ms / 1000,
        max_session_tokens=verifier.max_session_tokens,
        num_successors=config.num_successors,
        tree_limits=TreeLimits.of(verifier),
    )


def admission_limits(config: CoordinatorConfig) -> AdmissionLimits:
    return AdmissionLimits(
        max_running=config.max_concurrent_streams,
        max_queued=config.max_queued_streams,
        queue_timeout_s=config.queue_timeout_s,
        tenant_max_running=tenant_share(config),
    )


def tenant_share(config: CoordinatorConfig) -> int:
    """Streams one tenant may run (and have queued) unless its own setting says: the flag when given, else half
    the slots (at least 1) when callers authenticate, so no one tenant takes every slot and queue place; with
    authentication off every caller is the same tenant, so no share (0)."""
    if config.tenant_max_concurrent_streams is not None:
        return config.tenant_max_concurrent_streams
    if config.api_keys_file is None:
        return 0
    return max(1, config.max_concurrent_streams // 2)


def prompt_limits(config: CoordinatorConfig, verifier: VerifierInfo) -> PromptLimits:
    return PromptLimits(
        config.max_new_tokens_limit,
        verifier.max_session_tokens,
        max_prompt_bytes=config.max_prompt_bytes,
        max_chat_messages=config.max_chat_messages,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_bytes=config.max_stop_string_bytes,
    )


REQUEST_OVERHEAD_BYTES = 1 << 20
"""Room above --max-prompt-bytes in the largest request the coordinator receives: protobuf framing of up to
--max-chat-messages messages, the stop strings and the other fields. A prompt somewhat over the limit still
arrives and gets the clear INVALID_ARGUMENT; a request far over it is refused by gRPC (RESOURCE_EXHAUSTED)."""


def max_receive_message_bytes(config: CoordinatorConfig) -> int:
    return config.max_prompt_bytes + REQUEST_OVERHEAD_BYTES


CALL_HEADROOM = 32
"""Calls each server takes above the admission limits: reflection, and requests just past the queue, which then
hear admission's own refusal (with ``retry-after-ms``) rather than the call limit's."""


def max_concurrent_calls(config: CoordinatorConfig) -> int:
    """Calls (health aside) the gRPC server and the HTTP API each serve at once (``specserve.call_limit``): every
    slot, every queue place and ``CALL_HEADROOM``. One more is refused in our words: RESOURCE_EXHAUSTED (HTTP 429)
    with ``retry-after-ms``."""
    return config.max_concurrent_streams + config.max_queued_streams + CALL_HEADROOM


def grpc_call_backstop(config: CoordinatorConfig) -> int:
    """gRPC's own ``maximum_concurrent_rpcs``, the backstop above ``max_concurrent_calls``: room for the health
    watches and ``CALL_HEADROOM`` more (health checks, calls being refused). gRPC refuses a call past it before its
    request is read, so a flood holds no more prompts than this many; in practice the call limit answers first."""
    return max_concurrent_calls(config) + config.max_health_watches + CALL_HEADROOM


def http_connection_backstop(config: CoordinatorConfig) -> int:
    """uvicorn's ``limit_concurrency``, the HTTP API's backstop above ``max_concurrent_calls``: uvicorn counts open
    connections, idle keep-alive ones included, so it gets twice the calls; past it uvicorn answers a plain 503."""
    return 2 * max_concurrent_calls(config)


def tokenize_queue(config: CoordinatorConfig) -> int:
    """Prompts that may wait for a tokenizer thread: ``max_tokenize_queue``, or (0) every admitted stream."""
    return config.max_tokenize_queue or config.max_concurrent_streams
