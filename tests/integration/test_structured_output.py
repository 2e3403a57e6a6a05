"""Structured output through the three processes (issue #33), on the packaged SmolLM2.

The official ``openai`` client with ``response_format`` json_schema, whole and streamed: every output parses and
validates with ``jsonschema``; the same constraint over gRPC gives the same tokens (greedy); speculation off (plain
constrained decoding) gives them too; a bad schema is a 400 / INVALID_ARGUMENT naming the problem; a token limit
that cuts the value ends "length" with the constraint marked incomplete, and one below the schema's shortest output
is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat.completion_create_params import ResponseFormat

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port
from tests.integration.conftest import EVERY_ROUND_DRAFTS

pytestmark = pytest.mark.integration

TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population_millions", "is_capital"],
    "additionalProperties": False,
}
QUESTION = "Describe Paris as JSON with its city, country, population in millions and whether it is a capital."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("structured-logs")
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs, http_port=free_port())
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    cluster.extra_coordinator_args = ["--drafter-backoff-ms", "500"]
    with cluster as c:
        yield c


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_base_url, api_key="none", max_retries=0, timeout=180)


def _grpc(cluster: LocalCluster, params: GenerationParams) -> tuple[str, list[int], Stats]:
    with SpecserveClient(cluster.coordinator_address, timeout_s=180) as c:
        events = list(c.generate_chat([("user", QUESTION)], params))
    stats = events[-1]
    assert isinstance(stats, Stats)
    chunks = [e for e in events if isinstance(e, TextChunk)]
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], stats


def test_openai_json_schema_whole_and_streamed_validate(cluster: LocalCluster) -> None:
    fmt: ResponseFormat = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    client = _client(cluster)
    whole = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        response_format=fmt,
    )
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        response_format=fmt,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text
    # Sampled output validates too.
    sampled = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=TOKENS,
        temperature=1.0,
        seed=7,
        response_format=fmt,
    )
    if sampled.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(sampled.choices[0].message.content or ""), SCHEMA)
    # json_object on completions.
    obj = client.completions.create(
        model="smollm2",
        prompt="A JSON object describing a cat: ",
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)


def test_grpc_same_tokens_with_and_without_speculation(cluster: LocalCluster) -> None:
    schema = json.dumps(SCHEMA)
    text, tokens, stats = _grpc(cluster, GenerationParams(max_new_tokens=TOKENS, json_schema=schema))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert stats.finish_reason == "eos" and stats.constraint_complete
    assert stats.num_forced_tokens > 0  # keys and punctuation are forced
    assert 0 < stats.prefill_s < stats.verify_s  # the prompt's prefill, then the rounds
    plain_text, plain_tokens, plain = _grpc(
        cluster, GenerationParams(max_new_tokens=TOKENS, json_schema=schema, speculation="off")
    )
    assert plain_tokens == tokens and plain_text == text
    assert plain.num_draft_tokens == 0 and plain.num_forced_tokens == 0
    http = _client(cluster).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    assert http.choices[0].message.content == text


def test_regex_and_choice_over_grpc(cluster: LocalCluster) -> None:
    text, _, stats = _grpc(cluster, GenerationParams(max_new_tokens=16, regex=r"[0-9]{3}-[0-9]{4}"))
    assert len(text) == 8 and text[3] == "-" and stats.finish_reason == "eos"
    text, _, _ = _grpc(cluster, GenerationParams(max_new_tokens=16, choice=["yes", "no", "maybe"]))
    assert text in {"yes", "no", "maybe"}


def test_bad_schema_is_invalid_argument_and_400(cluster: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _grpc(cluster, GenerationParams(max_new_tokens=8, json_schema='{"type": "strin"}'))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "strin" in (caught.value.details() or "")
    with pytest.raises(openai.BadRequestError) as bad:
        _client(cluster).chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "weird"}},
            },
        )
    assert "weird" in str(bad.value)


def test_a_cut_value_ends_length_incomplete_and_a_hopeless_limit_is_refused(cluster: LocalCluster) -> None:
    schema = json.dumps(SCHEMA)
    text, tokens, stats = _grpc(cluster, GenerationParams(max_new_tokens=8, json_schema=schema))
    assert len(tokens) == 8 and text.startswith('{"city": "')
    assert (stats.finish_reason, stats.constraint_complete) == ("length", False)
    fmt: ResponseFormat = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    client = _client(cluster)
    cut = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        response_format=fmt,
    )
    assert cut.choices[0].message.content == text and cut.choices[0].finish_reason == "length"
    assert (cut.model_extra or {})["speculation"]["constraint_complete"] is False
    # '{"city": "' takes 4 tokens at the least, and the value is still open after them.
    with pytest.raises(grpc.RpcError) as caught:
        _grpc(cluster, GenerationParams(max_new_tokens=3, json_schema=schema))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes at least 4 tokens" in (caught.value.details() or "")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=3,
            response_format=fmt,
        )
    assert "takes at least 4 tokens" in str(bad.value)
