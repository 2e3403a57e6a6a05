"""Every refusal of the HTTP API names the OpenAI parameter the caller sent, in its message and in ``param``.

The frontend's own checks word their refusals in the gRPC API's fields (``max_new_tokens``); over HTTP a caller
must read the names it sent (``max_tokens``), with the server's configured limits. Checked twice: before the
frontend (a fake one with its limits), and through the real frontend for what only tokenizing or compiling
finds (a prompt past the context, a constraint that does not compile or cannot complete in the tokens allowed).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from coordinator.admission import AdmissionController
from coordinator.constraints.compiler import GrammarCompiler
from coordinator.frontend import CallInfo, EdgeRequest, GenerationBackend, GenerationFrontend
from coordinator.openai_api.app import create_app
from coordinator.prompts import PromptLimits
from coordinator.rounds import GenerationRequest
from specserve.errors import InvalidArgument
from specserve.tenancy import ANONYMOUS
from tests.unit.test_openai_api import CHAT, COMPLETION, LIMITS, MODEL, FakeFrontend, assert_error

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# What the frontend's own checks call things: an HTTP caller never sent these.
INTERNAL_NAMES = re.compile(r"max_new_tokens|lark_grammar|stop string \d|chat message \d|\bconstraint\b")


def refused(response: Any, param: str) -> str:
    """The message of a 400 invalid_request_error about ``param``, which names it and nothing internal."""
    error = assert_error(response, 400, param=param)
    assert error["type"] == "invalid_request_error", error
    assert param in error["message"], error
    assert not INTERNAL_NAMES.search(error["message"]), error
    message: str = error["message"]
    return message


# ---- checked before the frontend, against its limits ----


@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        (CHAT_PATH, {"max_tokens": -5}, "max_tokens", "between 1 and 256"),
        (CHAT_PATH, {"max_tokens": 257}, "max_tokens", "between 1 and 256"),
        (CHAT_PATH, {"max_completion_tokens": 0}, "max_completion_tokens", "between 1 and 256"),
        (CHAT_PATH, {"max_completion_tokens": -5}, "max_completion_tokens", "between 1 and 256"),
        (CHAT_PATH, {"max_tokens": 10**9}, "max_tokens", "got 1000000000"),
        (CHAT_PATH, {"max_completion_tokens": 10**9}, "max_completion_tokens", "got 1000000000"),
        (CHAT_PATH, {"max_tokens": 300, "max_completion_tokens": 300}, "max_tokens", "got 300"),
        (COMPLETIONS_PATH, {"max_tokens": -5}, "max_tokens", "between 1 and 256"),
        (COMPLETIONS_PATH, {"max_tokens": 1000}, "max_tokens", "got 1000"),
        (COMPLETIONS_PATH, {"max_tokens": 10**9}, "max_tokens", "got 1000000000"),
        (CHAT_PATH, {"temperature": -1}, "temperature", "between 0.001 and 100"),
        (COMPLETIONS_PATH, {"temperature": 1000}, "temperature", "got 1000"),
        (CHAT_PATH, {"top_p": 1.5}, "top_p", "[0, 1]"),
        (CHAT_PATH, {"top_k": -1}, "top_k", "between 0 (disabled)"),
        (CHAT_PATH, {"seed": -1}, "seed", "unsigned 64-bit"),
        (COMPLETIONS_PATH, {"seed": 2**64}, "seed", "unsigned 64-bit"),
        (CHAT_PATH, {"n": 0}, "n", "at least 1"),
        (COMPLETIONS_PATH, {"best_of": 0}, "best_of", "at least 1"),
        (CHAT_PATH, {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (CHAT_PATH, {"stop": ""}, "stop", "is empty"),
        (COMPLETIONS_PATH, {"stop": ["a", ""]}, "stop[1]", "is empty"),
        (COMPLETIONS_PATH, {"stop": ["x" * 17]}, "stop[0]", "at most 16 bytes"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}] * 9}, "messages", "at most 8"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "é" * 2049}]}, "messages", "at most 4096 bytes"),
        (COMPLETIONS_PATH, {"prompt": ""}, "prompt", "is empty"),
        (COMPLETIONS_PATH, {"prompt": [""]}, "prompt", "is empty"),
        (COMPLETIONS_PATH, {"prompt": "x" * 4097}, "prompt", "at most 4096 bytes"),
        (CHAT_PATH, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "an object"),
        (
            CHAT_PATH,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format.json_schema.schema",
            "a JSON Schema object",
        ),
        (CHAT_PATH, {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "a list of strings"),
        (COMPLETIONS_PATH, {"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "a string"),
        (CHAT_PATH, {"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        (CHAT_PATH, {"logprobs": True}, "logprobs", "not supported"),
        (CHAT_PATH, {"speculation": {"mode": "eager"}}, "speculation", "mode must be one of"),
    ],
)
def test_a_bad_parameter_is_refused_under_its_own_name(
    path: str, extra: dict[str, Any], param: str, words: str
) -> None:
    frontend = FakeFrontend()
    base = CHAT if path == CHAT_PATH else COMPLETION
    message = refused(TestClient(create_app(frontend)).post(path, json={**base, **extra}), param)
    assert words in message
    assert frontend.calls == []


@pytest.mark.parametrize("limit", [7, 4096])
def test_the_limits_in_messages_are_the_servers(limit: int) -> None:
    limits = replace(LIMITS, max_new_tokens=limit, max_stop_strings=limit)
    http = TestClient(create_app(FakeFrontend(limits=limits)))
    message = refused(http.post(CHAT_PATH, json={**CHAT, "max_tokens": limit + 1}), "max_tokens")
    assert f"between 1 and {limit} " in message
    stops = [str(i) for i in range(limit + 1)]
    assert f"at most {limit} " in refused(http.post(COMPLETIONS_PATH, json={**COMPLETION, "stop": stops}), "stop")


def test_the_completions_default_stays_within_a_lower_server_limit() -> None:
    frontend = FakeFrontend(limits=replace(LIMITS, max_new_tokens=8))
    assert TestClient(create_app(frontend)).post(COMPLETIONS_PATH, json=COMPLETION).status_code == 200
    assert frontend.request.max_new_tokens == 8  # OpenAI's 16 would be refused under a max_tokens never sent


# ---- through the real frontend ----


class CharTokenizer:
    """One token per character; the chat template joins the contents."""

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text)))}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
        return "".join(m["content"] for m in messages)


def grammar_compiler() -> GrammarCompiler:
    """A compiler over a four-token vocabulary: "ababab" takes three tokens at the least."""
    words = ["<eos>", "a", "b", "ab"]
    tokenizer = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[("a", "b")]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens(["<eos>"])
    return GrammarCompiler(SimpleNamespace(backend_tokenizer=tokenizer), len(words), [0], "tiny")


SERVED = PromptLimits(max_new_tokens=32, max_session_tokens=64)


def real_frontend() -> GenerationFrontend:
    def new_generation(request: GenerationRequest) -> Any:
        pytest.fail("a refused request must not start a generation")

    backend = GenerationBackend(CharTokenizer(), SERVED, new_generation, constraints=grammar_compiler())
    return GenerationFrontend(MODEL, AdmissionController(), None, backend)


@pytest.fixture(scope="module")
def http() -> TestClient:
    return TestClient(create_app(real_frontend()))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def test_the_issue_max_tokens_minus_five(http: TestClient) -> None:
    message = refused(http.post(CHAT_PATH, json=chat("Hi", max_tokens=-5)), "max_tokens")
    assert message == "max_tokens must be between 1 and 32 (this server's limit), got -5"


@pytest.mark.parametrize("value", [-5, 0, 33, 10**9])
@pytest.mark.parametrize(
    ("path", "name"),
    [(CHAT_PATH, "max_tokens"), (CHAT_PATH, "max_completion_tokens"), (COMPLETIONS_PATH, "max_tokens")],
)
def test_a_token_limit_out_of_range_is_refused_under_the_name_sent(
    http: TestClient, path: str, name: str, value: int
) -> None:
    """Whichever of the two names a chat caller used (OpenAI's newer ``max_completion_tokens`` or the older
    ``max_tokens``), the message and ``param`` are that one's, with the server's limit and the value sent."""
    body = chat("Hi", **{name: value}) if path == CHAT_PATH else {**COMPLETION, name: value}
    assert refused(http.post(path, json=body), name) == (
        f"{name} must be between 1 and 32 (this server's limit), got {value}"
    )


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_a_prompt_past_the_context_names_messages_and_the_token_limit_sent(http: TestClient, name: str) -> None:
    message = refused(http.post(CHAT_PATH, json=chat("x" * 40, **{name: 30})), "messages")
    assert message.startswith("messages has 40 tokens") and f"{name}=30" in message and "context of 64" in message


def test_a_completion_past_the_context_names_prompt(http: TestClient) -> None:
    body = {**COMPLETION, "prompt": "x" * 60, "max_tokens": 10}
    assert "max_tokens=10" in refused(http.post(COMPLETIONS_PATH, json=body), "prompt")


def test_a_chat_with_no_room_left_names_messages(http: TestClient) -> None:
    assert "no room for output" in refused(http.post(CHAT_PATH, json=chat("x" * 64)), "messages")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            'has an unknown type "strin"',
        ),
        ({"structured_outputs": {"json": '{"type": "strin"}'}}, "structured_outputs.json", "unknown type"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "not a valid regular expression"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", 'uses "foo"'),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "needs at least one string"),
    ],
)
def test_a_constraint_that_does_not_compile_is_named_as_sent(
    http: TestClient, extra: dict[str, Any], param: str, words: str
) -> None:
    message = refused(http.post(CHAT_PATH, json=chat("Hi", max_tokens=8, **extra)), param)
    assert message.startswith(f"{param} ") and words in message


def test_a_token_limit_below_the_constraints_shortest_output_names_it(http: TestClient) -> None:
    only = {"structured_outputs": {"choice": ["ababab"]}}
    message = refused(http.post(CHAT_PATH, json=chat("Hi", max_completion_tokens=2, **only)), "max_completion_tokens")
    assert message == (
        "max_completion_tokens is 2, but any output that completes this structured_outputs.choice takes at least "
        "3 tokens; raise max_completion_tokens"
    )
    # No token limit sent: as many as fit, and the context leaves 2.
    message = refused(http.post(CHAT_PATH, json=chat("x" * 62, **only)), "structured_outputs.choice")
    assert message.startswith("at most 2 tokens of output fit") and "at least 3 tokens" in message


def test_the_grpc_api_keeps_its_own_field_names() -> None:
    """Without names (the gRPC edge), the frontend's refusals are the domain's, naming gRPC's fields."""

    async def run() -> None:
        request = EdgeRequest(prompt="x" * 60, max_new_tokens=10)
        async for _ in real_frontend().generate(request, CallInfo("req", "grpc", ANONYMOUS)):
            pass

    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(run())
    assert "max_new_tokens=10" in str(caught.value) and caught.value.param is None
