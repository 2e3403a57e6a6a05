"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are strict about their fields: an unknown field is a 400 ("unrecognized request argument"), as it is
on OpenAI's own API, so a parameter we would ignore never changes the meaning of a request silently. Known
OpenAI parameters that specserve does not implement (``n`` > 1, ``logprobs``, ``tools``, ...) are declared here
so that ``coordinator.openai_api.translate`` can refuse them with a message that names them.

Accepted and ignored, because they never change the output: ``user``, ``safety_identifier``, ``metadata``,
``prompt_cache_key``, ``store: false``, ``service_tier: "auto" | "default"``.

Extensions (send them with the OpenAI client's ``extra_body``): ``speculation`` and ``top_k``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculationControl(_Strict):
    """Extension: ``{"mode": "auto" | "off", "max_draft_tokens": N}``; N caps draft tokens per round (0: no cap)."""

    mode: str = "auto"
    max_draft_tokens: int = 0


class StreamOptions(_Strict):
    include_usage: bool | None = None


class GenerationFields(_Strict):
    """What chat and completion requests share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extensions.
    speculation: SpeculationControl | None = None
    top_k: int | None = None  # as vLLM: 0 (or absent) means no top-k cut
    # Structured output: OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}, and
    # vLLM's extension {"regex" | "choice" | "grammar" | "json": ...}.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Harmless: they never change the output.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Known OpenAI parameters that specserve refuses unless given their no-op value (see translate.py).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    # Refused unless empty (see translate.py): no names, tools or audio in the chat template.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any | None = None
    prediction: Any | None = None
    reasoning_effort: Any | None = None
    verbosity: Any | None = None
    web_search_options: Any | None = None


class CompletionRequest(GenerationFields):
    # A string, or a list of one string; token-id prompts and batches are refused in translate.py.
    prompt: Any
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # of the prompt, tokens not prefilled: the verifier had them from an earlier request


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SpeculationStats(BaseModel):
    """Extension: how the request was speculated (vLLM's spec-decode counters, per request)."""

    mode: str  # "auto" or "off": what the request ran with
    max_draft_tokens: int  # its cap on draft tokens per round (0 when off)
    num_rounds: int  # target forwards
    num_drafts: int  # rounds whose tree held draft tokens
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]  # entry i: rounds whose accepted path reached depth i + 1
    acceptance_length: float  # tokens committed per target forward (tau)
    num_forced_tokens: int = 0  # accepted draft tokens the constraint alone allowed (structured output)
    constraint_complete: bool | None = None  # with a constraint: whether the output completed it


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: None = None
    speculation: SpeculationStats


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": text}; {} at the end
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: None = None
    usage: Usage | None = None  # only with stream_options.include_usage: null, and set on the last chunk
    speculation: SpeculationStats | None = None  # only on the last chunk


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always in a whole answer; in a stream only with include_usage
    system_fingerprint: None = None
    speculation: SpeculationStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
