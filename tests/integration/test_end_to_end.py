"""The three real processes with the real target: lossless output, bad input, a killed drafter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from client import GenerationParams, SpecserveClient, Stats, TextChunk
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.sampling import SamplingParams
from specserve.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.conftest import wait_until
from tests.integration.conftest import Target, spec_bench_prompts

pytestmark = pytest.mark.integration

CATEGORIES = ("writing", "coding", "summarization", "translation", "math_reasoning")


def generate(address: str, text: str, max_new_tokens: int) -> tuple[list[int], str, Stats]:
    return chat_turn(address, [("user", text)], max_new_tokens)


def test_spec_bench_prompts_are_token_identical_to_plain_greedy(cluster: LocalCluster, target: Target) -> None:
    prompts = spec_bench_prompts(per_category=1, categories=CATEGORIES)
    assert len(prompts) == 5
    drafted = hits = 0
    for record in prompts:
        text = record["turns"][0]
        tokens, streamed, stats = generate(cluster.coordinator_address, text, 40)
        assert tokens == target.greedy(target.chat_ids(text), 40), record["category"]
        assert streamed == target.tokenizer.decode(tokens, skip_special_tokens=True)
        assert stats.num_generated_tokens == len(tokens)
        assert stats.num_rounds + stats.num_accepted_tokens >= len(tokens)
        drafted += stats.num_draft_tokens
        hits += stats.num_predraft_hits
        ahead = f"pre-drafted {stats.num_predraft_hits}/{stats.num_drafter_trees}"
        print(f"{record['category']}: {stats.summary()}, {ahead}")
    assert drafted > 0
    assert hits > 0  # some trees were drafted ahead (while the verifier worked) and still nothing changed


def chat_turn(address: str, turns: list[tuple[str, str]], max_new_tokens: int) -> tuple[list[int], str, Stats]:
    tokens: list[int] = []
    pieces: list[str] = []
    with SpecserveClient(address) as client:
        for event in client.generate_chat(turns, GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
                pieces.append(event.text)
            else:
                return tokens, "".join(pieces), event
    raise AssertionError("the stream ended without stats")


def test_a_chats_next_turn_starts_from_the_last_turns_cache_and_decodes_the_same(
    cluster: LocalCluster, target: Target
) -> None:
    first = [("user", "Name three colours, one a line.")]
    _, answer, first_stats = chat_turn(cluster.coordinator_address, first, 24)
    second = [*first, ("assistant", answer), ("user", "Now three animals.")]
    tokens, _, stats = chat_turn(cluster.coordinator_address, second, 24)
    chat = [{"role": role, "content": content} for role, content in second]
    formatted = target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = target.tokenizer(formatted, add_special_tokens=False)["input_ids"]
    # The first turn's prompt at least came from its released session's kept cache.
    assert first_stats.num_prompt_tokens <= stats.num_cached_prompt_tokens < stats.num_prompt_tokens == len(ids)
    assert tokens == target.greedy(ids, 24)


def test_cli_streams_text_and_ends_with_stats(cluster: LocalCluster) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "client.cli", "generate", "Write a haiku about the sea", "--max-new-tokens", "24"],
        env={**os.environ, "SPECSERVE_ADDR": cluster.coordinator_address},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip()
    assert "24 tokens" in result.stderr and "tau" in result.stderr and "tokens/s" in result.stderr


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens must be between 1 and"),
        ({"prompt": "hi", "max_new_tokens": 100_000}, "max_new_tokens must be between 1 and"),
        ({"prompt": "word " * 9000}, "exceeds the model's context"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature must be 0 (greedy) or between"),
        ({"chat": [("robot", "hi")]}, "role 'robot'"),
    ],
)
def test_bad_requests_are_invalid_argument_and_the_service_stays_up(
    cluster: LocalCluster, request_kwargs: dict[str, object], message: str
) -> None:
    from client.sdk import build_request
    from specserve.v1 import generation_pb2_grpc

    params = GenerationParams(
        max_new_tokens=int(request_kwargs.get("max_new_tokens", 8)),  # type: ignore[call-overload]
        temperature=float(request_kwargs.get("temperature", 0.0)),  # type: ignore[arg-type]
    )
    request = build_request(request_kwargs.get("prompt"), request_kwargs.get("chat"), params)  # type: ignore[arg-type]
    with grpc.insecure_channel(cluster.coordinator_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    tokens, _, _ = generate(cluster.coordinator_address, "Say hi", 4)
    assert len(tokens) > 0


def test_verifier_rejects_unknown_sessions_and_malformed_trees(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.verifier_address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="nope", num_committed_tokens=1), timeout=30)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="t", token_ids=[1, 2, 3]), timeout=30)
        bad_trees = {
            "outside the vocabulary": common_pb2.TokenTree(token_ids=[1, 10**6], parents=[-1, 0]),
            "parents must come before": common_pb2.TokenTree(token_ids=[1, 2], parents=[1, -1]),
            "marked sampled": common_pb2.TokenTree(token_ids=[1], parents=[-1], sampled=[True]),
            "same length": common_pb2.TokenTree(token_ids=[1, 2], parents=[-1]),
        }
        for message, tree in bad_trees.items():
            with pytest.raises(grpc.RpcError) as error:
                stub.Verify(verifier_pb2.VerifyRequest(session_id="t", num_committed_tokens=3, tree=tree), timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()
        info = stub.VerifierInfo(verifier_pb2.VerifierInfoRequest(), timeout=30)
        assert info.vocab_size == 49152 and info.max_session_tokens == 8192 and info.vocab_fingerprint
        assert info.supports_branching and info.max_tree_depth > 0
        assert stub.Release(verifier_pb2.ReleaseRequest(session_id="t"), timeout=30).released


def test_the_verifier_counts_the_drafting_time_a_round_reports(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.verifier_address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        budgets = {}
        for session, draft_micros in (("drafts-quickly", 0), ("drafts-slowly", 10_000_000)):
            stub.Prefill(verifier_pb2.PrefillRequest(session_id=session, token_ids=[1, 2, 3]), timeout=30)
            tree = common_pb2.TokenTree(token_ids=[4], parents=[-1])
            request = verifier_pb2.VerifyRequest(
                session_id=session, num_committed_tokens=3, tree=tree, draft_micros=draft_micros
            )
            budgets[session] = stub.Verify(request, timeout=30).draft_budget_nodes
            stub.Release(verifier_pb2.ReleaseRequest(session_id=session), timeout=30)
        # This cluster's verifier runs without a start-up profile (a flat cost curve of one second a step, any
        # size): drafting that costs nothing pays, and no tree saves the ten seconds a draft took.
        assert budgets["drafts-quickly"] > 0
        assert budgets["drafts-slowly"] == 0


def test_drafter_stream_must_start_with_start(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.drafter_address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        propose = drafter_pb2.DraftRequest(propose=drafter_pb2.ProposeTree(max_nodes=4))
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Draft(iter([propose]), timeout=30))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_seeded_sampling_through_the_three_processes_is_plain_seeded_decoding(
    cluster: LocalCluster, target: Target
) -> None:
    """A seed fixes the text even though the shared pool learns from the first run and drafts differently, and
    with speculation off; the drafter's coupled drafts (its head samples with the target's keyed noise) are
    accepted."""
    text = "Tell me a short story about a cat."
    params = GenerationParams(max_new_tokens=40, temperature=0.7, top_p=0.95, top_k=50, seed=1234)
    runs = []
    accepted = 0
    for speculation in ("auto", "auto", "off"):
        params = replace(params, speculation=speculation)
        tokens: list[int] = []
        with SpecserveClient(cluster.coordinator_address) as client:
            for event in client.generate_chat([("user", text)], params):
                if isinstance(event, TextChunk):
                    tokens += event.token_ids
                else:
                    stats = event
        runs.append(tokens)
        accepted += stats.num_accepted_tokens
    assert runs[0] == runs[1] == runs[2]
    assert accepted > 0
    sampling = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed)
    assert runs[0] == target.decode(target.chat_ids(text), params.max_new_tokens, sampling)
    assert stats.num_generated_tokens == len(runs[0]) > 0
    assert stats.finish_reason in ("length", "eos")


def wait_for_drafter(address: str, timeout_s: float = 60.0) -> None:
    """Requests until one drafts: a test here that kills the drafter leaves the coordinator skipping it until its
    probe takes the restarted drafter back."""
    wait_until(
        lambda: not generate_with(address, "Say hi.", GenerationParams(max_new_tokens=2))[1].drafter_error,
        timeout_s,
        "requests draft again (the drafter is back)",
    )


@pytest.mark.parametrize(
    "sampling",
    [
        # Greedy in make test-slow: test_drafter_faults kills a drafter mid-generation under greedy in make test.
        pytest.param(SamplingParams(), id="greedy", marks=pytest.mark.slow),
        pytest.param(SamplingParams(temperature=0.7, seed=77), id="sampled"),
    ],
)
def test_killing_the_drafter_mid_generation_keeps_the_output_identical(
    cluster: LocalCluster, target: Target, sampling: SamplingParams
) -> None:
    """Greedy, and seeded sampling with coupled drafts: the text is plain decoding's whether or not a drafter
    drafted (and with which noise)."""
    text = "Write a long story about a dragon who learns to read."
    params = GenerationParams(max_new_tokens=160, temperature=sampling.temperature, seed=sampling.seed)
    wait_for_drafter(cluster.coordinator_address)
    chunks_seen = threading.Event()
    tokens: list[int] = []
    stats: list[Stats] = []

    def consume() -> None:
        with SpecserveClient(cluster.coordinator_address) as client:
            for event in client.generate_chat([("user", text)], params):
                if isinstance(event, TextChunk):
                    tokens.extend(event.token_ids)
                    if len(tokens) >= 8:
                        chunks_seen.set()
                else:
                    stats.append(event)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert chunks_seen.wait(timeout=120)
    cluster.kill("drafter")
    consumer.join(timeout=300)
    assert not consumer.is_alive()
    try:
        assert tokens == target.decode(target.chat_ids(text), 160, sampling)
        assert stats and stats[0].num_rounds_without_drafter > 0
        assert stats[0].drafter_error.startswith("drafter dropped")
    finally:
        cluster.start_drafter()


def test_sixteen_concurrent_streams_are_each_identical_to_plain_greedy(cluster: LocalCluster, target: Target) -> None:
    """One verifier batches 16 streams; each gets exactly its own plain decoding, and nothing is left behind."""
    prompts = [record["turns"][0] for record in spec_bench_prompts(per_category=2)][:16]
    assert len(prompts) == 16
    results: dict[int, tuple[list[int], str, Stats]] = {}

    def run(index: int) -> None:
        results[index] = generate(cluster.coordinator_address, prompts[index], 8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(results) == list(range(16))
    for index, text in enumerate(prompts):
        tokens, _, stats = results[index]
        assert tokens == target.greedy(target.chat_ids(text), 8), text[:60]
        assert stats.num_generated_tokens == len(tokens)
    with grpc.insecure_channel(cluster.verifier_address) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).VerifierInfo(
            verifier_pb2.VerifierInfoRequest(), timeout=10
        )
    assert info.dtype == "float32"
    assert info.num_active_sessions == 0 and info.kv_cache_used_bytes == 0 and info.num_queued_requests == 0
    assert info.kv_cache_capacity_bytes > 0


def generate_with(address: str, text: str, params: GenerationParams) -> tuple[list[int], Stats]:
    tokens: list[int] = []
    with SpecserveClient(address) as client:
        for event in client.generate_chat([("user", text)], params):
            if isinstance(event, TextChunk):
                tokens += event.token_ids
            else:
                return tokens, event
    raise AssertionError("the stream ended without stats")


def test_speculation_off_or_capped_gives_the_same_tokens_and_the_stats_say_so(
    cluster: LocalCluster, target: Target
) -> None:
    text = "List the planets of the solar system, one per line."
    expected = target.greedy(target.chat_ids(text), 32)
    wait_for_drafter(cluster.coordinator_address)
    runs = {
        name: generate_with(cluster.coordinator_address, text, GenerationParams(max_new_tokens=32, **kwargs))
        for name, kwargs in (("auto", {}), ("off", {"speculation": "off"}), ("cap2", {"max_draft_tokens": 2}))
    }
    for name, (tokens, _) in runs.items():
        assert tokens == expected, name
    auto, off, cap2 = (runs[name][1] for name in ("auto", "off", "cap2"))
    assert (off.speculation, off.max_draft_tokens, off.num_drafts, off.num_draft_tokens) == ("off", 0, 0, 0)
    assert off.num_rounds == len(expected) and off.drafter_error == ""
    assert auto.speculation == "auto" and auto.num_drafts > 0
    assert sum(auto.num_accepted_tokens_per_pos) == auto.num_accepted_tokens
    assert cap2.max_draft_tokens == 2 and cap2.num_draft_tokens <= 2 * cap2.num_drafts
    assert len(cap2.num_accepted_tokens_per_pos) <= 2
    # Each request is one JSON line in the coordinator's log, under the id its stats carry.
    assert cluster.log_dir is not None
    lines = [
        json.loads(line) for line in (cluster.log_dir / "coordinator.log").read_text().splitlines() if line[:1] == "{"
    ]
    logged = {line["request_id"]: line for line in lines if line.get("event") == "request"}
    for tokens, stats in runs.values():
        line = logged[stats.request_id]
        assert (line["status"], line["speculation"], line["completion_tokens"]) == (
            "OK",
            stats.speculation,
            len(tokens),
        )


def test_the_client_request_id_comes_back_in_the_initial_metadata(cluster: LocalCluster) -> None:
    request = generation_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2)
    with grpc.insecure_channel(cluster.coordinator_address) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            request, metadata=(("x-request-id", "it-42"),), timeout=60
        )
        responses = list(call)
        assert ("x-request-id", "it-42") in call.initial_metadata()
    assert responses[-1].stats.request_id == "it-42"


def find_grpcurl() -> str:
    """$GRPCURL, then the repo's .tools/bin/grpcurl (make grpcurl-tool), then PATH."""
    for candidate in (os.environ.get("GRPCURL"), str(Path(__file__).parents[2] / ".tools" / "bin" / "grpcurl")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("grpcurl")
    if found is None:
        pytest.skip("no grpcurl binary: run `make grpcurl-tool` (deploy/tools/fetch-grpcurl.sh) or set GRPCURL")
    return found


def test_grpcurl_lists_and_calls_the_service_through_reflection(cluster: LocalCluster) -> None:
    """No .proto files: grpcurl learns the API from the coordinator's reflection service, and its Generate
    streams the same tokens as the SDK's."""
    grpcurl = find_grpcurl()

    def run(*args: str) -> str:
        done = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    address = cluster.coordinator_address
    assert set(run(address, "list").split()) == {
        "specserve.v1.GenerationService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert run(address, "list", "specserve.v1.GenerationService").split() == ["specserve.v1.GenerationService.Generate"]

    prompt, max_new_tokens = "The capital of France is", 8
    body = json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens})
    output = run("-d", body, address, "specserve.v1.GenerationService/Generate")
    decoder, messages, rest = json.JSONDecoder(), [], output.strip()
    while rest:  # one JSON object per streamed message
        message, end = decoder.raw_decode(rest)
        messages.append(message)
        rest = rest[end:].lstrip()
    deltas: list[dict[str, Any]] = [m["delta"] for m in messages[:-1]]
    stats = messages[-1]["stats"]

    expected: list[int] = []
    with SpecserveClient(address) as client:
        for event in client.generate(prompt, GenerationParams(max_new_tokens=max_new_tokens)):
            if isinstance(event, TextChunk):
                expected += event.token_ids
    assert [token for delta in deltas for token in delta["token_ids"]] == expected
    assert stats["num_generated_tokens"] == len(expected) > 0


def test_the_verify_stream_answers_each_call_and_refuses_bad_ones_on_the_stream(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.verifier_address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="streamed", token_ids=[1, 2, 3]), timeout=30)
        calls = [
            verifier_pb2.VerifyRequest(session_id="nope", num_committed_tokens=1),
            verifier_pb2.VerifyRequest(session_id="streamed", num_committed_tokens=3),
        ]
        requests = [verifier_pb2.VerifyStreamRequest(call_id=i + 1, verify=call) for i, call in enumerate(calls)]
        answers = {answer.call_id: answer for answer in stub.VerifyStream(iter(requests), timeout=60)}
        assert answers[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]  # one call's refusal, not the stream's
        assert answers[2].WhichOneof("outcome") == "verify" and answers[2].verify.bonus_token_id >= 0
        assert stub.Release(verifier_pb2.ReleaseRequest(session_id="streamed"), timeout=30).released


def test_stream_and_unary_verify_transports_give_the_same_tokens(
    cluster: LocalCluster, target: Target, tmp_path: Path
) -> None:
    """A second coordinator on the same verifier and drafter, with unary Verify calls: the same greedy output."""
    port = free_port()
    args = ["--port", str(port), "--verifier", cluster.verifier_address, "--drafter", cluster.drafter_address]
    args += ["--model", cluster.model, "--http-port", "0", "--verify-transport", "unary"]
    with (tmp_path / "unary-coordinator.log").open("wb") as log:
        unary = subprocess.Popen([sys.executable, "-m", "coordinator", *args], stderr=log)
        try:
            wait_serving(f"127.0.0.1:{port}", 120, unary)
            for record in spec_bench_prompts(per_category=1, categories=("coding", "writing")):
                text = record["turns"][0]
                streamed, _, _ = generate(cluster.coordinator_address, text, 32)
                called, _, stats = generate(f"127.0.0.1:{port}", text, 32)
                assert streamed == called == target.greedy(target.chat_ids(text), 32), record["category"]
                assert stats.num_rounds > 0
        finally:
            unary.terminate()
            unary.wait(timeout=30)
