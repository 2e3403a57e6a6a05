"""The coordinator's settings, declared once (flags, environment variables, docs table), and what follows from
them."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.admission import AdmissionLimits
from coordinator.ports import VerifierInfo
from coordinator.prompts import PromptLimits
from coordinator.rounds import RoundPolicy
from coordinator.tree_checks import TreeLimits
from specserve.auth.tls import ClientTLS
from specserve.model_loading import DEFAULT_MODEL
from specserve.service_main import (
    COORDINATOR_PORT,
    DRAFTER_PORT,
    HTTP_PORT,
    LOOPBACK,
    VERIFIER_PORT,
    ServiceConfig,
    grpc_port,
)
from specserve.settings import setting


@dataclass(frozen=True)
class CoordinatorConfig(ServiceConfig):
    """The coordinator's settings (``specserve.settings``); ``coordinator.main`` parses them once."""

    port: int = grpc_port(COORDINATOR_PORT)
    http_port: int = setting(
        HTTP_PORT,
        "port of the OpenAI-compatible HTTP API on --host, with --tls-cert/--tls-key when set (0: off)",
        env="SPECSERVE_HTTP_PORT",
    )
    verifier: str = setting(
        f"{LOOPBACK}:{VERIFIER_PORT}",
        "the verifier tier: host:port[,host:port...], dns:///NAME:PORT (every resolved replica, re-resolved every "
        "30 s; sessions are pinned to one) or k8s://NAMESPACE/SERVICE:PORT (the Service's EndpointSlices, watched "
        "through the Kubernetes API with the pod's service account or $KUBECONFIG; PORT is a number or the port's "
        "name)",
        env="SPECSERVE_VERIFIER_ADDR",
    )
    drafter: str | None = setting(
        f"{LOOPBACK}:{DRAFTER_PORT}",
        "the drafter tier, in the same forms as --verifier; empty: decode without drafting",
        env="SPECSERVE_DRAFTER_ADDR",
    )
    zone: str = setting(
        "",
        "this coordinator's zone: with a k8s:// --drafter, drafter endpoints in it get its sessions first",
        env="SPECSERVE_ZONE",
    )
    self_service: str = setting(
        "",
        "NAMESPACE/SERVICE of the coordinator's own Service: without --zone, the zone is read from this pod's "
        "(POD_NAME) entry in its EndpointSlices",
        env="SPECSERVE_SELF_SERVICE",
    )
    model: str = setting(
        DEFAULT_MODEL,
        "model whose tokenizer and chat template to use (must match the verifier's)",
        env="SPECSERVE_MODEL",
    )
    served_model_name: str = setting(
        "",
        "the model name clients use (the HTTP API's `model`, /v1/models); empty: --model",
        env="SPECSERVE_SERVED_MODEL_NAME",
        shown="`--model`",
    )
    cache_dir: str | None = setting(
        None, "where GGUF models are converted once", env="SPECSERVE_CACHE_DIR", shown="`~/.cache/specserve`"
    )
    max_new_tokens_limit: int = setting(4096, "per-request ceiling of new tokens")
    max_prompt_bytes: int = setting(
        4 << 20,
        "most UTF-8 bytes in a prompt, or in a chat's message contents together (INVALID_ARGUMENT beyond); the "
        "largest gRPC message accepted is 1 MiB above it",
        shown="4 MiB",
    )
    max_chat_messages: int = setting(1024, "most messages in a chat")
    max_stop_strings: int = setting(16, "most stop strings per request")
    max_stop_string_bytes: int = setting(256, "most UTF-8 bytes in each stop string")
    # The round loop's own defaults (coordinator.rounds.RoundPolicy), defined there once.
    max_draft_tokens: int = setting(
        RoundPolicy.max_draft_tokens,
        "most draft tokens (tree nodes) asked of the drafter each round; a request's max_draft_tokens may only "
        "lower it",
    )
    num_successors: int = setting(
        RoundPolicy.num_successors,
        "the target's likeliest next tokens per scored position, returned by each Verify and sent to the drafter "
        "(Token Recycling; 0: off)",
    )
    gate_drafting: bool = setting(
        True,
        "each session drafts only while its drafted rounds commit more tokens per second than its plain rounds, "
        "end to end, probing now and then (off: the verifier's draft budget alone decides)",
    )
    draft_timeout_ms: int = setting(
        round(RoundPolicy.draft_timeout_s * 1000),
        "most a draft round trip may take (the timeout follows the drafter's p99 latency below it); a slower "
        "drafter is dropped for the request",
    )
    draft_timeout_floor_ms: int = setting(
        100, "least draft timeout: 4x the drafter's p99 latency, clamped to [floor, --draft-timeout-ms]"
    )
    drafter_backoff_ms: int = setting(
        5000,
        "how long new requests skip a drafter that failed, timed out or sent a bad tree (doubles per failure in a "
        "row), before it is probed again",
    )
    drafter_max_backoff_ms: int = setting(60_000, "longest drafter backoff")
    verifier_timeout_s: float = setting(120.0, "deadline of one call to the verifier")
    verify_transport: str = setting(
        "stream",
        "how Verify calls reach a verifier replica: stream (one VerifyStream per replica carries every session's "
        "rounds; a verifier without it gets unary calls) or unary (one call per round)",
        env="SPECSERVE_VERIFY_TRANSPORT",
        choices=("stream", "unary"),
    )
    verify_ahead: bool = setting(
        RoundPolicy.verify_ahead,
        "a session whose next round is to be plain (speculation off, no drafter, drafting not paying, or no draft "
        "budget from the verifier) sends that round's Verify before the current one's answer is back, so the "
        "verifier steps it at once (with --verify-transport stream, which keeps a session's calls in order)",
    )
    startup_timeout_s: float = setting(900.0, "how long to wait for the verifier to load its model")
    metrics_token_file: str | None = setting(
        None,
        "file holding a token that /metrics (--metrics-port) then requires as `Authorization: Bearer <token>`; "
        "unset: /metrics is open to whoever reaches the port",
        env="SPECSERVE_METRICS_TOKEN_FILE",
        shown="open",
    )
    api_keys_file: str | None = setting(
        None,
        "YAML file of API key digests and tenants (reloaded when it changes); unset: no authentication (loopback "
        "only, or --insecure)",
        env="SPECSERVE_API_KEYS_FILE",
        shown="auth off",
    )
    api_keys_reload_s: float = setting(5.0, "how often to check the API key file for changes")
    internal_tls_ca: str | None = setting(
        None,
        "PEM CA of the workers: TLS towards the verifier and drafters (any of the three internal TLS settings "
        "turns it on)",
        env="SPECSERVE_INTERNAL_TLS_CA",
        shown="plaintext",
    )
    internal_tls_cert: str | None = setting(
        None, "PEM client certificate for workers that require mTLS", env="SPECSERVE_INTERNAL_TLS_CERT"
    )
    internal_tls_key: str | None = setting(
        None, "PEM private key of --internal-tls-cert", env="SPECSERVE_INTERNAL_TLS_KEY"
    )
    # Admission (coordinator.admission): the default matches one verifier's engine step (its
    # --max-batch-sessions), the queue its --max-sessions.
    max_concurrent_streams: int = setting(
        64, "generations running at once; more wait in the queue", env="SPECSERVE_MAX_CONCURRENT_STREAMS"
    )
    max_queued_streams: int = setting(
        256,
        "generations waiting for a slot; more are refused with RESOURCE_EXHAUSTED (and retry-after-ms)",
        env="SPECSERVE_MAX_QUEUED_STREAMS",
    )
    queue_timeout_s: float = setting(
        30.0,
        "how long a generation waits for a slot before it is refused with RESOURCE_EXHAUSTED",
        env="SPECSERVE_QUEUE_TIMEOUT_S",
    )
    tenant_max_concurrent_streams: int | None = setting(
        None,
        "generations one tenant may run at once (and have waiting) unless its own setting says; 0: no limit; "
        "unset: half of --max-concurrent-streams with --api-keys-file (so no one tenant takes every slot and "
        "queue place), else no limit (every caller is one tenant)",
        env="SPECSERVE_TENANT_MAX_CONCURRENT_STREAMS",
        shown="half the slots with --api-keys-file",
    )
    max_tokenize_queue: int = setting(
        0,
        "admitted prompts waiting for one of the tokenizer threads (each holds its text); more: "
        "RESOURCE_EXHAUSTED. 0: --max-concurrent-streams, the most that can wait (a prompt is tokenized only once "
        "its request holds a slot)",
        env="SPECSERVE_MAX_TOKENIZE_QUEUE",
        shown="0 (= `--max-concurrent-streams`)",
    )


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
        gate_drafting=config.gate_drafting,
        verify_ahead=config.verify_ahead,
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
