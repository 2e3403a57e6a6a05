"""OpenAI requests -> ``EdgeRequest``; ``GenerationStats`` -> ``usage`` and the speculation stats.

Defaults follow OpenAI's API, not specserve's gRPC API: ``temperature`` 1 (the gRPC default is greedy), and
``/v1/completions`` generates 16 tokens unless told (chat: as many as fit; both within the server's limit). A
parameter specserve does not implement is refused with a 400 that names it, unless given its no-op value
(``n: 1``, ``logprobs: false``, ``presence_penalty: 0``, ...). Structured output: ``response_format``
(``json_object``, ``json_schema``) on both endpoints, and vLLM's ``structured_outputs`` extension (``regex``,
``choice``, ``grammar``, ``json``).

Every refusal names the parameter the caller sent, in its message and in ``param``: the frontend's own checks
word theirs in the gRPC API's fields (``max_new_tokens``), so each parameter is checked here first against the
server's limits (``GenerationFrontend.limits``), and the request carries its ``ParamNames`` for what only
tokenizing or compiling finds (a prompt past the context, a constraint that does not compile or fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from coordinator.constraints.spec import Constraint, ConstraintKind
from coordinator.frontend import EdgeRequest, ParamNames
from coordinator.openai_api.errors import ApiError
from coordinator.openai_api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    PromptTokensDetails,
    SpeculationStats,
    Usage,
)
from coordinator.prompts import ChatTurn, PromptLimits
from coordinator.rounds import FinishReason, GenerationStats
from coordinator.speculation import Speculation
from specserve.errors import InvalidArgument
from specserve.sampling import GREEDY, SamplingParams

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions

# Roles of the chat template; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_HARMLESS_SERVICE_TIERS = (None, "auto", "default")

Rule = tuple[str, Callable[[Any], bool], str]

_NO_TOOLS = "tool and function calling is not supported"
_COMMON_RULES: list[Rule] = [
    ("n", lambda v: v == 1, "n > 1 is not supported: specserve returns one choice per request (send n=1 or omit it)"),
    ("presence_penalty", lambda v: v == 0, "presence_penalty is not supported (send 0 or omit it)"),
    ("frequency_penalty", lambda v: v == 0, "frequency_penalty is not supported (send 0 or omit it)"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported (send {} or omit it)"),
    ("store", lambda v: v is False, "store is not supported: specserve keeps no completions (send false or omit it)"),
    (
        "service_tier",
        lambda v: v in _HARMLESS_SERVICE_TIERS,
        "service_tier must be 'auto' or 'default': specserve has one tier",
    ),
]
_CHAT_RULES: list[Rule] = [
    *_COMMON_RULES,
    ("logprobs", lambda v: v is False, "logprobs is not supported (send false or omit it)"),
    ("top_logprobs", lambda v: v == 0, "top_logprobs is not supported (send 0 or omit it)"),
    ("tools", lambda v: not v, _NO_TOOLS),
    ("tool_choice", lambda v: v == "none", _NO_TOOLS),
    ("functions", lambda v: not v, _NO_TOOLS),
    ("function_call", lambda v: v == "none", _NO_TOOLS),
    ("parallel_tool_calls", lambda v: False, _NO_TOOLS),
    ("modalities", lambda v: v == ["text"], "only the 'text' modality is supported"),
    ("audio", lambda v: False, "audio output is not supported"),
    ("prediction", lambda v: False, "predicted outputs are not supported"),
    ("reasoning_effort", lambda v: False, "reasoning_effort is not supported: the model does not reason"),
    ("verbosity", lambda v: False, "verbosity is not supported"),
    ("web_search_options", lambda v: False, "web search is not supported"),
]
_COMPLETION_RULES: list[Rule] = [
    *_COMMON_RULES,
    ("logprobs", lambda v: False, "logprobs is not supported (omit it)"),
    ("echo", lambda v: v is False, "echo is not supported (send false or omit it)"),
    ("best_of", lambda v: v == 1, "best_of > 1 is not supported (send 1 or omit it)"),
    ("suffix", lambda v: v == "", "suffix is not supported: specserve does not insert text (omit it)"),
]


def _refuse_unsupported(request: GenerationFields, rules: list[Rule]) -> None:
    for name in ("n", "best_of"):  # below 1 is no request at all, not an unsupported one
        count = getattr(request, name, None)
        if count is not None and count < 1:
            raise ApiError.invalid(f"{name} must be at least 1, got {count}", param=name)
    for name, harmless, why in rules:
        value = getattr(request, name)
        if value is not None and not harmless(value):
            message = why if why.startswith(name) else f"{name}: {why}"
            raise ApiError.invalid(message, param=name, code="unsupported_parameter")


def _speculation(request: GenerationFields) -> Speculation:
    if request.speculation is None:
        return Speculation()
    try:
        return Speculation.parse(request.speculation.mode, request.speculation.max_draft_tokens)
    except InvalidArgument as exc:
        raise ApiError.invalid(str(exc), param="speculation") from exc


# SamplingParams' fields are named as OpenAI's parameters, and its ValueErrors begin with the field's name.
_SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "seed")


def _sampling(request: GenerationFields) -> SamplingParams:
    sampling = SamplingParams(
        temperature=OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        seed=request.seed,
    )
    for name in _SAMPLING_PARAMS:  # one at a time, so that the error names the parameter at fault
        try:
            replace(GREEDY, **{name: getattr(sampling, name)}).validate()
        except ValueError as exc:
            raise ApiError.invalid(str(exc), param=name) from None
    return sampling


def _stop(request: GenerationFields, limits: PromptLimits | None) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    stops = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)
    if limits is not None and len(stops) > limits.max_stop_strings:
        raise ApiError.invalid(
            f"stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed", param="stop"
        )
    for i, text in enumerate(stops):
        where = "stop" if isinstance(request.stop, str) else f"stop[{i}]"
        if not text:
            raise ApiError.invalid(f"{where} is empty: every stop string needs at least one character", param=where)
        if limits is not None and (size := len(text.encode())) > limits.max_stop_string_bytes:
            raise ApiError.invalid(
                f"{where} is {size} bytes long (UTF-8); at most {limits.max_stop_string_bytes} bytes are allowed",
                param=where,
            )
    return stops


def _max_tokens(name: str, value: int | None, limits: PromptLimits | None) -> int | None:
    """The token limit the caller sent as ``name``, within 1 and the server's limit."""
    if value is None:
        return None
    if limits is None:  # the frontend is not attached: it refuses the request itself
        if value < 1:
            raise ApiError.invalid(f"{name} must be at least 1, got {value}", param=name)
    elif not 1 <= value <= limits.max_new_tokens:
        raise ApiError.invalid(
            f"{name} must be between 1 and {limits.max_new_tokens} (this server's limit), got {value}", param=name
        )
    return value


def _check_text_size(param: str, size: int, limits: PromptLimits | None) -> None:
    if limits is not None and size > limits.max_prompt_bytes:
        raise ApiError.invalid(
            f"the text of {param} is {size} bytes (UTF-8); at most {limits.max_prompt_bytes} bytes are allowed: "
            "send less text",
            param=param,
        )


def _check_stream_options(request: GenerationFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise ApiError.invalid("stream_options is only allowed when stream is true", param="stream_options")


def include_usage(request: GenerationFields) -> bool:
    """A stream ends with a chunk carrying ``usage`` (and every chunk before it has ``"usage": null``)."""
    return bool(request.stream and request.stream_options and request.stream_options.include_usage)


def _text_content(message: ChatMessage, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined with newlines, as vLLM does)."""
    content = message.content
    if content is None:
        raise ApiError.invalid(f"messages[{i}] has no content: every message needs text", param=f"messages[{i}]")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.get("type") != "text":
            raise ApiError.invalid(
                f"{where} is of type {part.get('type')!r}: only text parts are supported (no images, audio or files)",
                param=where,
            )
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise ApiError.invalid(f"{where} must be {{'type': 'text', 'text': <string>}}", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def _turn(message: ChatMessage, i: int) -> ChatTurn:
    role = _ROLES.get(message.role)
    if role is None:
        why = "tool and function messages are not supported" if message.role in ("tool", "function") else ""
        raise ApiError.invalid(
            f"messages[{i}] has role {message.role!r}: use system, developer, user or assistant"
            + (f" ({why})" if why else ""),
            param=f"messages[{i}].role",
        )
    for name in ("name", "tool_calls", "tool_call_id", "function_call", "audio"):
        if getattr(message, name):
            raise ApiError.invalid(
                f"messages[{i}].{name} is not supported: the chat template has no place for it",
                param=f"messages[{i}].{name}",
                code="unsupported_parameter",
            )
    if message.refusal:
        raise ApiError.invalid(f"messages[{i}].refusal is not supported", param=f"messages[{i}].refusal")
    return ChatTurn(role, _text_content(message, i))


def _chat_max_tokens(request: ChatCompletionRequest) -> tuple[str, int | None]:
    """The token limit and the name the caller sent it under (both given: they must agree)."""
    if request.max_tokens is None:
        if request.max_completion_tokens is not None:
            return "max_completion_tokens", request.max_completion_tokens
        return "max_tokens", None
    if request.max_completion_tokens not in (None, request.max_tokens):
        raise ApiError.invalid(
            "max_tokens and max_completion_tokens disagree: send one of them", param="max_completion_tokens"
        )
    return "max_tokens", request.max_tokens


def chat_request(request: ChatCompletionRequest, limits: PromptLimits | None = None) -> EdgeRequest:
    """The request as the frontend takes it, checked against ``limits`` (None: the frontend's checks alone)."""
    _refuse_unsupported(request, _CHAT_RULES)
    _check_stream_options(request)
    if not request.messages:
        raise ApiError.invalid("messages is empty: send at least one message", param="messages")
    if limits is not None and len(request.messages) > limits.max_chat_messages:
        raise ApiError.invalid(
            f"messages has {len(request.messages)} messages; at most {limits.max_chat_messages} are allowed: "
            "drop or summarise earlier turns",
            param="messages",
        )
    name, max_tokens = _chat_max_tokens(request)
    chat = tuple(_turn(m, i) for i, m in enumerate(request.messages))
    _check_text_size("messages", sum(len(turn.content.encode()) for turn in chat), limits)
    constraint, constraint_name = _constraint(request)
    return EdgeRequest(
        chat=chat,
        max_new_tokens=_max_tokens(name, max_tokens, limits),
        sampling=_sampling(request),
        stop=_stop(request, limits),
        speculation=_speculation(request),
        constraint=constraint,
        names=ParamNames(max_new_tokens=name, text="messages", constraint=constraint_name),
    )


def _constraint(request: GenerationFields) -> tuple[Constraint | None, str]:
    """``response_format`` or ``structured_outputs`` as a constraint (None: free text) and the parameter that holds
    its text; both at once is refused."""
    from_format = _response_format(request.response_format)
    from_extension = _structured_outputs(request.structured_outputs)
    if from_format[0] is not None and from_extension[0] is not None:
        raise ApiError.invalid("send response_format or structured_outputs, not both", param="structured_outputs")
    return from_format if from_format[0] is not None else from_extension


def _response_format(value: dict[str, Any] | None) -> tuple[Constraint | None, str]:
    kind = (value or {}).get("type", "text")
    if value is None or kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return Constraint.json_schema({"type": "object"}), "response_format"
    if kind != "json_schema":
        raise ApiError.invalid(
            f"response_format.type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
            param="response_format",
            code="unsupported_parameter",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError.invalid(
            "response_format.json_schema must be an object: {'name': ..., 'schema': {...}}",
            param="response_format.json_schema",
        )
    where = "response_format.json_schema.schema"
    if not isinstance(spec.get("schema"), dict):
        raise ApiError.invalid(f"{where} must be a JSON Schema object", param=where)
    return Constraint.json_schema(spec["schema"]), where


_STRUCTURED_KINDS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "grammar": ConstraintKind.LARK_GRAMMAR,
}


def _structured_outputs(value: dict[str, Any] | None) -> tuple[Constraint | None, str]:
    """vLLM's extension: exactly one of ``json`` (a schema), ``regex``, ``choice`` (strings), ``grammar`` (Lark)."""
    if not value:
        return None, "structured_outputs"
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    unknown = sorted(set(value) - {"json", "regex", "choice", "grammar"})
    if unknown or len(given) != 1:
        raise ApiError.invalid(
            "structured_outputs takes exactly one of json, regex, choice, grammar"
            + (f" (unknown: {', '.join(unknown)})" if unknown else ""),
            param="structured_outputs",
        )
    kind, body = given[0], value[given[0]]
    where = f"structured_outputs.{kind}"
    if kind == "choice":
        if not isinstance(body, list) or not all(isinstance(c, str) for c in body):
            raise ApiError.invalid(f"{where} must be a list of strings", param=where)
        return Constraint(ConstraintKind.CHOICE, choices=tuple(body)), where
    if kind == "json":
        if isinstance(body, dict):
            return Constraint.json_schema(body), where
        if not isinstance(body, str):
            raise ApiError.invalid(f"{where} must be a schema object", param=where)
    if not isinstance(body, str):
        raise ApiError.invalid(f"{where} must be a string", param=where)
    return Constraint(_STRUCTURED_KINDS[kind], body), where


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise ApiError.invalid(
            f"prompt is a list of {len(prompt)} strings: send one prompt per request", param="prompt"
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, int | list) for p in prompt):
        raise ApiError.invalid("token-id prompts are not supported: send the prompt as text", param="prompt")
    raise ApiError.invalid("prompt must be a string (or a list of one string)", param="prompt")


def completion_request(request: CompletionRequest, limits: PromptLimits | None = None) -> EdgeRequest:
    """The request as the frontend takes it, checked against ``limits`` (None: the frontend's checks alone)."""
    _refuse_unsupported(request, _COMPLETION_RULES)
    _check_stream_options(request)
    prompt = _prompt_text(request.prompt)
    if not prompt:
        raise ApiError.invalid("prompt is empty: send the text to complete", param="prompt")
    _check_text_size("prompt", len(prompt.encode()), limits)
    max_tokens = _max_tokens("max_tokens", request.max_tokens, limits)
    if max_tokens is None:  # OpenAI's default, within a server whose limit is lower still
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        if limits is not None:
            max_tokens = min(max_tokens, limits.max_new_tokens)
    constraint, constraint_name = _constraint(request)
    return EdgeRequest(
        prompt=prompt,
        max_new_tokens=max_tokens,
        sampling=_sampling(request),
        stop=_stop(request, limits),
        speculation=_speculation(request),
        constraint=constraint,
        names=ParamNames(max_new_tokens="max_tokens", text="prompt", constraint=constraint_name),
    )


def finish_reason(stats: GenerationStats) -> str:
    """OpenAI's finish_reason: "length" at the token limit, "stop" at a stop string or the end of text."""
    return "length" if stats.finish_reason is FinishReason.LENGTH else "stop"


def usage(stats: GenerationStats) -> Usage:
    return Usage(
        prompt_tokens=stats.num_prompt_tokens,
        completion_tokens=stats.num_generated_tokens,
        total_tokens=stats.num_prompt_tokens + stats.num_generated_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.num_cached_prompt_tokens),
    )


def speculation_stats(stats: GenerationStats) -> SpeculationStats:
    return SpeculationStats(
        mode=stats.speculation.value,
        max_draft_tokens=stats.max_draft_tokens,
        num_rounds=stats.num_rounds,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos),
        acceptance_length=round(stats.tau, 4),
        num_forced_tokens=stats.num_forced_tokens,
        constraint_complete=stats.constraint_complete if stats.constrained else None,
    )
