"""The OpenAI-compatible HTTP API on one real cluster (API keys on), driven by the official `openai` client and curl.

Greedy answers over HTTP are token-identical to the gRPC API's (client.sdk) for the same request; speculation off
gives the same tokens with no draft tokens; a wrong key is a 401 with OpenAI's error body; curl -N shows the
server-sent events as they come; a client that goes away mid-stream ends its generation (CANCELLED in the log).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from client import GenerationParams, SpecserveClient, Stats
from specserve.auth.keys import key_entry, new_key
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from tests.conftest import wait_until
from tests.integration.conftest import EVERY_ROUND_DRAFTS, EVERY_ROUND_DRAFTS_COORDINATOR

pytestmark = pytest.mark.integration

KEY = new_key()
MODEL = "smollm2"  # --model of LocalCluster; GET /v1/models names it
TOKENS = 16
QUESTION = "Name three rivers in Europe."
PROMPT = "The three largest rivers of Europe are"


@dataclass
class Served:
    cluster: LocalCluster
    logs: Path
    _grpc: dict[tuple[str | None, str | None], tuple[str, Stats]] = field(default_factory=dict)

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.cluster.http_base_url, api_key=api_key, max_retries=0, timeout=120)

    def grpc_text(self, prompt: str | None = None, chat: str | None = None) -> tuple[str, Stats]:
        """The gRPC API's greedy answer (asked once per module: the slow part of these tests is generating)."""
        if (prompt, chat) in self._grpc:
            return self._grpc[prompt, chat]
        params = GenerationParams(max_new_tokens=TOKENS)
        with SpecserveClient(self.cluster.coordinator_address, timeout_s=120, api_key=KEY) as c:
            stream = c.generate(prompt, params) if prompt is not None else c.generate_chat([("user", chat)], params)
            events = list(stream)
        stats = events[-1]
        assert isinstance(stats, Stats)
        self._grpc[prompt, chat] = "".join(e.text for e in events[:-1] if not isinstance(e, Stats)), stats
        return self._grpc[prompt, chat]

    def wait_drafting(self, timeout_s: float = 60) -> None:
        """Until a request drafts: the coordinator starts once the verifier is up, the drafter may come later."""
        wait_serving(self.cluster.drafter_address, timeout_s)
        with SpecserveClient(self.cluster.coordinator_address, timeout_s=120, api_key=KEY) as c:

            def drafted() -> bool:
                stats = list(c.generate("Warm up:", GenerationParams(max_new_tokens=8)))[-1]
                return isinstance(stats, Stats) and stats.num_draft_tokens > 0

            wait_until(drafted, timeout_s, "a request drafts (is the drafter up?)", every_s=0.5)

    def request_lines(self) -> list[dict[str, object]]:
        text = (self.logs / "coordinator.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith('{"ts"')]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("openai-http")
    keys = directory / "api-keys.yaml"
    keys.write_text("keys:\n" + key_entry(KEY, "http-tests", "ci") + "\n")
    logs = directory / "logs"
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs, http_port=free_port())
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    # A drafter that is not up yet when the first request comes is skipped briefly, not for the default 5 s.
    cluster.extra_coordinator_args = [
        *EVERY_ROUND_DRAFTS_COORDINATOR,
        "--api-keys-file",
        str(keys),
        "--drafter-backoff-ms",
        "500",
    ]
    with cluster:
        served = Served(cluster, logs)
        served.wait_drafting()
        yield served


def test_models_names_the_served_model(served: Served) -> None:
    assert [m.id for m in served.client().models.list()] == [MODEL]


def test_chat_matches_grpc_streamed_or_not(served: Served) -> None:
    expected, stats = served.grpc_text(chat=QUESTION)
    assert expected and stats.num_draft_tokens > 0  # the cluster speculates
    client = served.client()
    messages = [{"role": "user", "content": QUESTION}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, extra_headers={"X-Request-Id": "it-chat-1"}
    )
    assert raw.headers["x-request-id"] == "it-chat-1"
    whole = raw.parse()
    assert whole.id == "chatcmpl-it-chat-1" and whole.model == MODEL
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == ("length" if stats.finish_reason == "length" else "stop")
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        stats.num_prompt_tokens,
        stats.num_generated_tokens,
    )
    speculation = (whole.model_extra or {})["speculation"]
    assert speculation["mode"] == "auto" and speculation["num_draft_tokens"] > 0

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert (chunks[-1].model_extra or {})["speculation"]["num_drafts"] > 0


def test_completion_matches_grpc_streamed_or_not(served: Served) -> None:
    expected, stats = served.grpc_text(prompt=PROMPT)
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage is not None and whole.usage.completion_tokens == stats.num_generated_tokens
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_speculation_off_gives_the_same_tokens_without_drafts(served: Served) -> None:
    expected, _ = served.grpc_text(chat=QUESTION)
    answer = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"speculation": {"mode": "off"}},
    )
    assert answer.choices[0].message.content == expected
    speculation = (answer.model_extra or {})["speculation"]
    assert speculation["mode"] == "off" and speculation["max_draft_tokens"] == 0
    assert speculation["num_drafts"] == speculation["num_draft_tokens"] == speculation["num_accepted_tokens"] == 0
    assert speculation["acceptance_length"] == 1.0  # one token per target forward


def test_a_wrong_key_is_401_with_openai_error_body(served: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        served.client(api_key="ssk_not-a-key").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key" and "unknown or was revoked" in body["error"]["message"]
    unauthenticated = httpx.get(f"{served.cluster.http_base_url}/models")
    assert unauthenticated.status_code == 401 and unauthenticated.headers["x-request-id"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_streams_server_sent_events(served: Served) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
    url = f"{served.cluster.http_base_url}/chat/completions"
    headers = ["-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json"]
    result = subprocess.run(
        ["curl", "-sS", "-N", "-i", url, *headers, "-d", json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    head, _, stream = result.stdout.replace("\r\n", "\n").partition("\n\n")
    print(result.stdout)  # the transcript, with -s
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    events = [e for e in stream.split("\n\n") if e]
    assert len(events) >= 4 and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") and "speculation" in chunks[-1]


def test_a_client_that_goes_away_ends_its_generation(served: Served) -> None:
    url = f"{served.cluster.http_base_url}/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "it-gone-1"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    mine = wait_until(
        lambda: [line for line in served.request_lines() if line["request_id"] == "it-gone-1"],
        20,
        "the request's log line is written",
    )
    assert mine[0]["status"] == "CANCELLED" and mine[0]["api"] == "openai.completions"
    assert mine[0]["completion_tokens"] < 400  # ended when the client left, not after its 400 tokens


def test_on_sigterm_running_streams_finish_and_new_requests_get_503(served: Served) -> None:
    """Last in the module: the coordinator drains and exits (uvicorn left the signal to the coordinator)."""
    expected, _ = served.grpc_text(prompt=PROMPT)
    coordinator = served.cluster.processes["coordinator"]
    base = served.cluster.http_base_url
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    texts: list[str] = []
    with httpx.stream("POST", f"{base}/completions", json=body, headers=auth, timeout=120) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        texts.append(json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"])
        coordinator.send_signal(signal.SIGTERM)
        # The signal is handled at the loop's next turn; 30 s only ends a hang.
        health = wait_until(
            lambda: (reply := httpx.get(base.removesuffix("/v1") + "/health")).status_code == 503 and reply,
            30,
            "the HTTP health says 503",
            every_s=0.05,
        )
        assert health.json() == {"status": "draining"}
        refused = httpx.post(f"{base}/completions", json={**body, "stream": False}, headers=auth)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    texts += [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == expected and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert coordinator.wait(timeout=30) == 0
