"""The OpenAI-compatible HTTP API against a fake frontend: translation, validation, errors, SSE, request ids."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.admission import Slot
from coordinator.frontend import CallInfo, EdgeRequest
from coordinator.openai_api.app import create_app, max_body_bytes
from coordinator.prompts import ChatTurn, PromptLimits
from coordinator.rounds import FinishReason, GenerationStats, TextChunk
from coordinator.speculation import Speculation, SpeculationMode
from specserve.auth.interceptors import KEYS_REVOKED
from specserve.auth.keys import ApiKeys, key_entry, new_key
from specserve.drain import Drain
from specserve.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SpecserveError,
    Unavailable,
)
from specserve.tenancy import ANONYMOUS

MODEL = "smollm2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time"}
LIMITS = PromptLimits(
    max_new_tokens=256,
    max_session_tokens=1024,
    max_prompt_bytes=4096,
    max_chat_messages=8,
    max_stop_strings=4,
    max_stop_string_bytes=16,
)


def stats(**overrides: Any) -> GenerationStats:
    values: dict[str, Any] = {
        "num_prompt_tokens": 7,
        "num_generated_tokens": 3,
        "num_rounds": 2,
        "num_drafts": 1,
        "num_draft_tokens": 4,
        "num_accepted_tokens": 1,
        "num_accepted_tokens_per_pos": [1],
        "finish_reason": FinishReason.LENGTH,
        "speculation": SpeculationMode.AUTO,
        "max_draft_tokens": 8,
    }
    values.update(overrides)
    return GenerationStats(**values)


class FakeFrontend:
    """Yields ``texts`` as chunks, then ``final``; raises ``before`` first or ``after`` once the texts are out."""

    served_model = MODEL

    def __init__(
        self,
        texts: tuple[str, ...] = ("Hello", " world"),
        final: GenerationStats | None = None,
        before: Exception | None = None,
        after: Exception | None = None,
        hold: asyncio.Event | None = None,
        limits: PromptLimits | None = LIMITS,
    ) -> None:
        self.ready = True
        self.limits = limits  # what the HTTP API checks a request against before it reaches the frontend
        self.texts = texts
        self.final = final or stats()
        self.before = before
        self.after = after
        self.hold = hold
        self.calls: list[tuple[EdgeRequest, CallInfo]] = []
        self.ended: list[str] = []  # how each generation ended: "done", "error", "cancelled", "closed"
        self.admitted = 0  # slots taken (``admit``) and given back
        self.released = 0

    async def admit(self, call: CallInfo) -> Slot:
        self.admitted += 1
        return Slot(0.0, self._released)

    def _released(self) -> None:
        self.released += 1

    async def generate(
        self, request: EdgeRequest, call: CallInfo, slot: Slot | None = None
    ) -> AsyncIterator[TextChunk | GenerationStats]:
        self.calls.append((request, call))
        how = "closed"
        try:
            if self.before is not None:
                raise self.before
            for text in self.texts:
                yield TextChunk(text, [1])
            if self.hold is not None:
                await self.hold.wait()
            if self.after is not None:
                raise self.after
            yield self.final
            how = "done"
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except SpecserveError:
            how = "error"
            raise
        finally:
            self.ended.append(how)

    @property
    def request(self) -> EdgeRequest:
        return self.calls[-1][0]


def client(frontend: FakeFrontend, **kwargs: Any) -> TestClient:
    return TestClient(create_app(frontend, **kwargs))


def events(response: Any) -> list[Any]:
    """The SSE events of a streamed response: parsed JSON, or the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == "", "the stream must end with a blank line"
    out: list[Any] = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        data = frame.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(response: Any, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert "Traceback" not in response.text
    assert response.headers.get("x-request-id")
    error: dict[str, Any] = body["error"]
    return error


# ---- translation ----


def test_chat_completion_whole() -> None:
    frontend = FakeFrontend()
    response = client(frontend).post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    rid = response.headers["x-request-id"]
    body = response.json()
    assert body["id"] == f"chatcmpl-{rid}" and body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["speculation"] == {
        "mode": "auto",
        "max_draft_tokens": 8,
        "num_rounds": 2,
        "num_drafts": 1,
        "num_draft_tokens": 4,
        "num_accepted_tokens": 1,
        "num_accepted_tokens_per_pos": [1],
        "acceptance_length": 1.5,
        "num_forced_tokens": 0,
        "constraint_complete": None,
    }
    request, call = frontend.calls[0]
    # OpenAI's defaults: temperature 1, no token limit in chat (as many as fit).
    assert request.chat == (ChatTurn("user", "Hi"),) and request.prompt is None
    assert request.max_new_tokens is None and request.sampling.temperature == 1.0 and request.sampling.top_p == 1.0
    assert request.speculation == Speculation()
    assert call == CallInfo(request_id=rid, api="openai.chat", tenant=ANONYMOUS)
    assert frontend.ended == ["done"]


def test_chat_parameters_reach_the_frontend() -> None:
    frontend = FakeFrontend()
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a river"}]},
        {"role": "assistant", "content": "Nile"},
        {"role": "user", "content": "Another"},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": 12,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 40,
        "seed": 7,
        "stop": "\n",
        "n": 1,
        "user": "u-1",
        "metadata": {"team": "x"},
        "speculation": {"mode": "auto", "max_draft_tokens": 3},
    }
    assert client(frontend).post("/v1/chat/completions", json=body).status_code == 200
    request = frontend.request
    assert request.chat == (
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "Name\na river"),
        ChatTurn("assistant", "Nile"),
        ChatTurn("user", "Another"),
    )
    assert request.max_new_tokens == 12 and request.stop == ("\n",)
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.0, 0.5, 40, 7)
    assert request.speculation == Speculation(SpeculationMode.AUTO, 3)


def test_completion_whole_and_its_defaults() -> None:
    frontend = FakeFrontend(final=stats(finish_reason=FinishReason.EOS))
    http = client(frontend)
    response = http.post("/v1/completions", json={**COMPLETION, "stop": ["a", "b"], "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == f"cmpl-{response.headers['x-request-id']}" and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 10 and body["speculation"]["num_draft_tokens"] == 4
    assert frontend.request.prompt == "Once upon a time" and frontend.request.chat is None
    assert frontend.request.stop == ("a", "b") and frontend.request.max_new_tokens == 5
    assert frontend.calls[-1][1].api == "openai.completions"
    # OpenAI's default for /v1/completions: 16 tokens. A list of one prompt is one prompt.
    assert http.post("/v1/completions", json={**COMPLETION, "prompt": ["one"]}).status_code == 200
    assert frontend.request.max_new_tokens == 16 and frontend.request.prompt == "one"


def test_speculation_off_and_finish_reasons() -> None:
    final = stats(speculation=SpeculationMode.OFF, max_draft_tokens=0, finish_reason=FinishReason.STOP)
    frontend = FakeFrontend(final=final)
    body = {**CHAT, "speculation": {"mode": "off"}}
    response = client(frontend).post("/v1/chat/completions", json=body)
    assert frontend.request.speculation == Speculation(SpeculationMode.OFF)
    assert response.json()["speculation"]["mode"] == "off" and response.json()["choices"][0]["finish_reason"] == "stop"


# ---- streaming ----


def test_chat_stream_frames() -> None:
    frontend = FakeFrontend()
    response = client(frontend).post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-cache"
    out = events(response)
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    rid = response.headers["x-request-id"]
    assert all(c["id"] == f"chatcmpl-{rid}" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": " world"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)  # not asked for
    assert "speculation" not in chunks[0] and chunks[-1]["speculation"]["num_drafts"] == 1
    assert frontend.ended == ["done"]


def test_stream_include_usage() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    out = events(client(FakeFrontend(final=stats(num_cached_prompt_tokens=2))).post("/v1/completions", json=body))
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hello", " world", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1]) and "speculation" not in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert chunks[-1]["speculation"]["acceptance_length"] == 1.5


def test_stream_options_need_stream() -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    assert_error(client(FakeFrontend()).post("/v1/chat/completions", json=body), 400, param="stream_options")


def test_error_after_the_stream_began_is_an_event_then_done() -> None:
    frontend = FakeFrontend(after=Unavailable("the verifier went away"))
    out = events(client(frontend).post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert [c["choices"][0]["delta"] for c in out[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": " world"},
    ]
    assert out[3] == {
        "error": {"message": "the verifier went away", "type": "server_error", "param": None, "code": "unavailable"}
    }
    assert out[4:] == ["[DONE]"]
    assert frontend.ended == ["error"]


def test_a_bug_after_the_stream_began_shows_a_ref_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    frontend = FakeFrontend(after=ZeroDivisionError("secret detail"))
    response = client(frontend).post("/v1/completions", json={**COMPLETION, "stream": True})
    out = events(response)
    error = out[-2]["error"]
    assert error["type"] == "server_error" and error["message"].startswith("internal error ")
    assert "secret detail" not in response.text and out[-1] == "[DONE]"
    ref = error["message"].split()[2].rstrip(";")
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)


# ---- errors ----


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (InvalidArgument("the prompt is empty"), 400, "invalid_request_error", "invalid_argument"),
        (PermissionDenied("not yours"), 403, "permission_error", "permission_denied"),
        (Unavailable("no verifier"), 503, "server_error", "unavailable"),
        (DeadlineExceeded("too slow"), 504, "server_error", "timeout"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_domain_errors_before_the_first_token_get_their_status(
    error: SpecserveError, status: int, kind: str, code: str, stream: bool
) -> None:
    frontend = FakeFrontend(before=error)
    response = client(frontend).post("/v1/chat/completions", json={**CHAT, "stream": stream})
    body = assert_error(response, status, code)
    assert body["type"] == kind and body["message"] == str(error)
    assert response.headers["content-type"] == "application/json"


def test_overload_is_429_with_retry_after() -> None:
    refusal = ResourceExhausted("the queue is full; retry after 1500 ms", metadata=(("retry-after-ms", "1500"),))
    response = client(FakeFrontend(before=refusal)).post("/v1/completions", json={**COMPLETION, "stream": True})
    assert assert_error(response, 429, "rate_limit_exceeded")["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "2" and response.headers["retry-after-ms"] == "1500"


def test_a_bug_is_500_with_a_ref(caplog: pytest.LogCaptureFixture) -> None:
    response = client(FakeFrontend(before=KeyError("secret detail"))).post("/v1/chat/completions", json=CHAT)
    error = assert_error(response, 500, "internal_error")
    assert error["message"].startswith("internal error ") and "secret" not in response.text
    ref = error["message"].split()[2].rstrip(";")
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_bug_outside_the_generation_is_500_too() -> None:
    class Broken(FakeFrontend):
        def generate(self, request: EdgeRequest, call: CallInfo, slot: Slot | None = None) -> AsyncIterator[Any]:
            raise RuntimeError("secret detail")

    response = client(Broken()).post("/v1/chat/completions", json=CHAT)
    assert assert_error(response, 500, "internal_error")["message"].startswith("internal error ")
    assert "secret" not in response.text


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"n": 3}, "n"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(path: str, extra: dict[str, Any], param: str) -> None:
    frontend = FakeFrontend()
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    error = assert_error(client(frontend).post(path, json={**base, **extra}), 400, "unsupported_parameter", param)
    assert error["type"] == "invalid_request_error" and param in error["message"]
    assert frontend.calls == []


@pytest.mark.parametrize(
    "harmless",
    [
        {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "store": False},
        {"user": "alice", "safety_identifier": "h", "metadata": {"k": "v"}, "prompt_cache_key": "p"},
        {"service_tier": "auto", "modalities": ["text"], "top_logprobs": 0},
    ],
)
def test_no_op_values_of_unsupported_parameters_are_fine(harmless: dict[str, Any]) -> None:
    assert client(FakeFrontend()).post("/v1/chat/completions", json={**CHAT, **harmless}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({**CHAT, "frobnicate": 1}, "frobnicate", "unrecognized request argument"),
        ({**CHAT, "stream_options": {"include_usage": True, "x": 1}, "stream": True}, "stream_options.x", "unrecog"),
        ({"model": MODEL}, "messages", "missing required parameter"),
        ({**CHAT, "max_tokens": "many"}, "max_tokens", "invalid value"),
        ({**CHAT, "messages": [{"role": "user", "content": "a", "name": "bob"}]}, "messages[0].name", "name"),
        ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages[0].role", "tool"),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0]", "no content"),
        ({**CHAT, "messages": []}, "messages", "at least one"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            "only text parts",
        ),
        ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "disagree"),
        ({**CHAT, "speculation": {"mode": "eager"}}, "speculation", "mode must be one of"),
        ({**CHAT, "speculation": {"mode": "off", "max_draft_tokens": 4}}, "speculation", "speculation is off"),
        ({**CHAT, "speculation": {"mode": "auto", "max_draft_tokens": -1}}, "speculation", "max_draft_tokens"),
        ({**CHAT, "speculation": {"mode": "auto", "depth": 3}}, "speculation.depth", "unrecognized"),
        ({**COMPLETION, "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({**COMPLETION, "prompt": [1, 2, 3]}, "prompt", "token-id prompts"),
        ({**COMPLETION, "prompt": 5}, "prompt", "must be a string"),
    ],
)
def test_invalid_requests_are_400_with_a_message(body: dict[str, Any], param: str, words: str) -> None:
    frontend = FakeFrontend()
    path = "/v1/chat/completions" if "messages" in body or "prompt" not in body else "/v1/completions"
    error = assert_error(client(frontend).post(path, json=body), 400, param=param)
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert frontend.calls == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_a_body_that_is_not_a_json_object_is_400(raw: bytes) -> None:
    response = client(FakeFrontend()).post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert assert_error(response, 400)["type"] == "invalid_request_error"


def test_an_oversized_body_is_413_unread() -> None:
    response = client(FakeFrontend(), max_prompt_bytes=100).post(
        "/v1/completions", json={**COMPLETION, "prompt": "x" * (max_body_bytes(100) + 1)}
    )
    assert assert_error(response, 413, "request_too_large")["message"].startswith("the request body is over")


def test_an_unknown_model_is_404_model_not_found() -> None:
    frontend = FakeFrontend()
    http = client(frontend)
    error = assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "model_not_found")
    assert error["param"] == "model" and "'smollm2'" in error["message"]
    assert_error(http.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert frontend.calls == []


def test_unknown_routes_and_methods_get_openai_error_bodies() -> None:
    http = client(FakeFrontend())
    assert_error(http.post("/v1/embeddings", json={}), 404, "unknown_url")
    assert_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")


# ---- models, health, request ids ----


def test_models() -> None:
    http = client(FakeFrontend(), clock=lambda: 1_700_000_000.5)
    listing = http.get("/v1/models").json()
    assert listing == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 1_700_000_000, "owned_by": "specserve"}],
    }
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_health_follows_readiness_and_drain() -> None:
    frontend = FakeFrontend()
    drain = Drain(grace_s=5)
    http = client(frontend, drain=drain)
    frontend.ready = False
    assert http.get("/health").status_code == 503
    frontend.ready = True
    assert http.get("/health").status_code == 200
    drain.begin()
    assert http.get("/health").json() == {"status": "draining"}
    error = assert_error(http.post("/v1/chat/completions", json=CHAT), 503, "unavailable")
    assert "shutting down" in error["message"] and frontend.calls == []


@pytest.mark.parametrize(
    ("sent", "kept"),
    [("trace-42.a_b", True), ("x" * 128, True), ("x" * 129, False), ("has space", False), ("", False)],
)
def test_request_id_header(sent: str, kept: bool) -> None:
    frontend = FakeFrontend()
    response = client(frontend).post("/v1/chat/completions", json=CHAT, headers={"x-request-id": sent})
    rid = response.headers["x-request-id"]
    assert (rid == sent) is kept and rid and frontend.calls[0][1].request_id == rid
    assert response.json()["id"] == f"chatcmpl-{rid}"


def test_every_response_has_a_request_id() -> None:
    http = client(FakeFrontend())
    for response in (http.get("/health"), http.get("/nowhere"), http.post("/v1/completions", content=b"{")):
        assert len(response.headers["x-request-id"]) == 32


# ---- auth ----


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[tuple[ApiKeys, str]]:
    key = new_key()
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  acme: {max_concurrent_streams: 2}\nkeys:\n" + key_entry(key, "acme", "ci") + "\n")
    yield ApiKeys(path), key


def test_api_keys(keys: tuple[ApiKeys, str]) -> None:
    api_keys, key = keys
    frontend = FakeFrontend()
    http = client(frontend, keys=api_keys)
    missing = assert_error(http.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
    assert "Authorization: Bearer" in missing["message"]
    wrong = http.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer ssk_wrong"})
    assert "unknown or was revoked" in assert_error(wrong, 401, "invalid_api_key")["message"]
    assert wrong.headers["www-authenticate"].startswith("Bearer")
    assert_error(http.get("/v1/models"), 401)
    assert frontend.calls == []
    assert http.get("/health").status_code == 200  # probes need no key
    good = http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
    assert good.status_code == 200
    assert frontend.calls[0][1].tenant.name == "acme" and frontend.calls[0][1].tenant.max_concurrent_streams == 2
    assert http.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200


def test_a_deleted_key_file_refuses_every_key(tmp_path: Path) -> None:
    key = new_key()
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + key_entry(key, "acme", "ci") + "\n")
    api_keys = ApiKeys(path)
    frontend = FakeFrontend()
    http = client(frontend, keys=api_keys)
    path.unlink()
    api_keys.reload()  # what the next periodic check does
    refused = http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
    error = assert_error(refused, 401, "invalid_api_key")
    assert error["message"] == KEYS_REVOKED and str(tmp_path) not in error["message"]
    assert frontend.calls == []


# ---- a client that goes away ----


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_generation(stream: bool) -> None:
    """The ASGI app driven by hand: the client disconnects while the generation waits for its next round."""

    async def scenario() -> tuple[FakeFrontend, list[dict[str, Any]], Drain]:
        hold = asyncio.Event()  # never set: the generation would wait forever
        frontend = FakeFrontend(hold=hold)
        drain = Drain(grace_s=5)
        app = create_app(frontend, drain=drain)
        body = json.dumps({**CHAT, "stream": stream}).encode()
        gone = asyncio.Event()
        inbox = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }
        call = asyncio.create_task(app(scope, receive, send))
        async with asyncio.timeout(30):  # only a guard against a hang
            while drain.outstanding == 0 or (stream and len(sent) < 4):  # start, role chunk, "Hello", " world"
                await asyncio.sleep(0.01)
        assert frontend.ended == []
        gone.set()
        async with asyncio.timeout(5):
            await call
        return frontend, sent, drain

    frontend, sent, drain = asyncio.run(scenario())
    assert frontend.ended == ["cancelled"]  # the generation was cancelled (its session released), not left waiting
    assert drain.outstanding == 0
    if stream:
        bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b"Hello" in bodies and b"[DONE]" not in bodies
    else:
        assert not any(m["type"] == "http.response.start" for m in sent)


def test_the_slot_is_taken_before_the_body_is_read_and_always_given_back() -> None:
    frontend = FakeFrontend()
    http = client(frontend)
    assert_error(http.post("/v1/chat/completions", content=b"{not json"), 400, "invalid_json")
    assert (frontend.admitted, frontend.released, frontend.calls) == (1, 1, [])
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert http.post("/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 200
    assert (frontend.admitted, frontend.released, len(frontend.calls)) == (3, 3, 2)


def test_a_request_with_no_room_is_refused_at_admission_without_generating() -> None:
    class Full(FakeFrontend):
        async def admit(self, call: CallInfo) -> Slot:
            raise ResourceExhausted("full; retry after 250 ms", metadata=(("retry-after-ms", "250"),))

    frontend = Full()
    response = client(frontend).post("/v1/chat/completions", json=CHAT)
    assert_error(response, 429, "rate_limit_exceeded")
    assert response.headers["retry-after-ms"] == "250" and frontend.calls == []
