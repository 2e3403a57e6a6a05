"""bench.peers_report on made-up timings: rates, ratios to llama.cpp, token agreement and the report (no llama_cpp)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from bench.peers_report import LLAMA_CPP, ModeResult, Run, borrow_prompt_times, markdown, summarize_all, write_outputs

EOS = 2
S = 1_000_000_000  # ns


def run(tokens: list[int], total_s: float, prompt_s: float, eos: bool = False, rounds: int | None = None) -> Run:
    committed = len(tokens) + int(eos)
    return Run(tokens, eos, int(total_s * S), int(prompt_s * S), committed if rounds is None else rounds)


REFERENCE = [list(range(10, 110)), [*range(10, 40), EOS]]  # prompt 1 ends at EOS after 30 tokens


def results() -> list[ModeResult]:
    llama = ModeResult(
        LLAMA_CPP,
        "llama.cpp",
        "Q4_1",
        # Prompt 1 differs from fp32 plain decoding at position 5; both 100 tokens, no EOS.
        [run(REFERENCE[0], 2.0, 0.5), run([*range(10, 15), 99, *range(16, 110)], 2.0, 0.5)],
        identical_to="plain-float32",
    )
    plain = ModeResult(
        "plain-float32",
        "verifier",
        "float32",
        [run(REFERENCE[0], 4.0, 1.0), run(REFERENCE[1][:-1], 2.5, 1.0, eos=True)],
    )
    speculative = ModeResult(
        "speculative-float32",
        "inproc",
        "float32",
        borrow_prompt_times(
            [run(REFERENCE[0], 2.0, 0.0, rounds=40), run(REFERENCE[1][:-1], 1.5, 0.0, eos=True, rounds=20)],
            plain.runs,
        ),
        prompt_time_from="plain-float32",
        identical_to="plain-float32",
    )
    return [llama, plain, speculative]


def meta() -> dict[str, Any]:
    return {
        "started_at": "2026-01-01 00:00 UTC",
        "duration_s": 12.0,
        "settings": {
            "model_source": "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
            "category": "coding",
            "prompts_requested": 20,
            "prompts": 2,
            "max_new_tokens": 100,
            "threads": 2,
            "n_ctx": 4096,
            "auto_dtype": "float32",
            "auto_dtype_reason": "auto: CPU has neither AMX nor AVX512-BF16",
            "cases": [
                {"index": 0, "category": "coding", "question_id": 121, "prompt_tokens": 50},
                {"index": 1, "category": "coding", "question_id": 122, "prompt_tokens": 60},
            ],
        },
        "machine": {
            "cpu_model": "Test CPU",
            "cpus_available": 2,
            "cpu_bf16_flags": [],
            "torch_version": "2.x",
            "git_commit": "abc1234",
            "git_dirty": False,
            "load_average_at_start": [0.1, 0.1, 0.1],
            "load_average_at_end": [0.2, 0.1, 0.1],
        },
        "llama_cpp": {
            "version": "0.3.36",
            "build_flags": "llama-cpp-python==0.3.36 CMAKE_ARGS=-DGGML_NATIVE=OFF -DGGML_AVX2=ON",
            "system_info": "CPU : AVX2 = 1 | AVX512 = 0",
        },
    }


def test_prompt_times_are_borrowed_and_capped_at_the_total() -> None:
    borrowed = borrow_prompt_times([run([1], 1.0, 0.0), run([1], 0.5, 0.0)], [run([1], 9.0, 0.25), run([1], 9.0, 2.0)])
    assert [r.prompt_ns for r in borrowed] == [S // 4, S // 2]


def test_rates_and_ratios_against_llama_cpp() -> None:
    summaries, _ = summarize_all(results(), EOS)
    llama, plain, speculative = summaries
    assert llama.tokens == 200 and llama.decode_s == 3.0 and llama.prompt_s == 1.0
    assert llama.decode_tokens_per_s == pytest.approx(200 / 3.0)
    assert llama.total_tokens_per_s == pytest.approx(50.0)
    assert llama.decode_ratio == pytest.approx(1.0) and llama.tau == 1.0
    # plain: 130 tokens (the EOS is not one), decode 6.5 - 2 = 4.5 s, total 6.5 s.
    assert plain.tokens == 130 and plain.decode_s == pytest.approx(4.5)
    assert plain.decode_ratio == pytest.approx((130 / 4.5) / (200 / 3.0))
    assert plain.total_ratio == pytest.approx((130 / 6.5) / 50.0)
    # speculative: the plain prefill times (1 s each) stand in; decode 3.5 - 2 = 1.5 s; 131 committed / 60 rounds.
    assert speculative.prompt_s == pytest.approx(2.0) and speculative.decode_s == pytest.approx(1.5)
    assert speculative.decode_ratio == pytest.approx((130 / 1.5) / (200 / 3.0))
    assert speculative.tau == pytest.approx(131 / 60)


def test_token_agreement_counts_prompts_and_finds_the_first_difference() -> None:
    summaries, compared = summarize_all(results(), EOS)
    llama, plain, speculative = summaries
    assert (llama.identical, llama.identical_to) == (1, "plain-float32")
    assert plain.identical is None and "plain-float32" not in compared
    assert speculative.identical == 2
    first, second = compared[LLAMA_CPP]
    assert first.identical and first.position is None
    # The reference ended at EOS after 30 tokens; llama.cpp differs earlier, at position 5.
    assert (second.identical, second.position, second.reference_token, second.mode_token) == (False, 5, 15, 99)


def test_no_llama_cpp_run_leaves_the_ratios_out() -> None:
    summaries, _ = summarize_all(results()[1:], EOS)
    assert all(s.decode_ratio is None and s.total_ratio is None for s in summaries)
    assert summaries[1].identical == 2


def test_markdown_states_ratios_build_and_divergences() -> None:
    summaries, compared = summarize_all(results(), EOS)
    text = markdown(meta(), summaries, compared)
    assert "| speculative-float32 |" in text and f"{(130 / 1.5) / (200 / 3.0):.2f}x" in text
    assert "1/2 to plain-float32" in text and "2/2 to plain-float32" in text
    assert "-DGGML_AVX2=ON" in text and "AVX512 = 0" in text
    assert "of 20 asked for" in text  # the coding category holds fewer prompts than asked for
    assert "## llama.cpp against plain-float32" in text
    assert "| 1 | coding | 122 | 5 | 15 | 99 |" in text
    assert "plain-float32's on the same prompt" in text  # where the speculative prompt time comes from


def test_write_outputs_round_trips_through_json(tmp_path: Path) -> None:
    summaries, paths = write_outputs(tmp_path / "peers", meta(), results(), EOS)
    assert [p.name for p in paths] == ["peers.json", "peers.md"]
    document = json.loads(paths[0].read_text())
    assert [s["mode"] for s in document["summaries"]] == [s.mode for s in summaries]
    assert document["agreement"][LLAMA_CPP][1]["position"] == 5
    assert document["modes"][2]["runs"][0]["prompt_ns"] == S
    assert paths[1].read_text().startswith("# Peers")


def test_without_llama_cpp_the_command_exits_2_and_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import peers

    monkeypatch.setattr(peers, "import_llama_cpp", lambda: None)
    assert peers.main(["--prompts", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "llama-cpp-python is not installed: run `make bench-peers` (it builds it)"
    )


def test_the_gguf_file_name_gives_its_quantization() -> None:
    from bench.peers import gguf_quantization

    assert gguf_quantization(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "Q4_1"
    assert gguf_quantization(Path("model-f16.gguf")) == "f16"
    assert gguf_quantization(Path("model.gguf")) == "gguf"


def test_the_three_processes_are_compared_with_plain_decoding_and_given_its_prompt_times() -> None:
    from bench.modes import DistributedMode
    from bench.peers import ModeEngine, results_of

    plain = SimpleNamespace(name="plain-float32", engine="verifier", dtype="float32")
    distributed = ModeEngine(DistributedMode.__new__(DistributedMode), "float32")  # a mode never run here
    runs = {
        "plain-float32": [run(REFERENCE[0], 4.0, 1.0)],
        "distributed-float32": [run(REFERENCE[0], 3.0, 0.0, rounds=50)],
    }
    found = {r.name: r for r in results_of(cast(Any, [plain, distributed]), runs, "plain-float32")}
    assert found["distributed-float32"].identical_to == "plain-float32"
    assert found["distributed-float32"].prompt_time_from == "plain-float32"
    assert found["distributed-float32"].runs[0].prompt_ns == S  # plain decoding's prefill on the same prompt
    assert found["plain-float32"].identical_to == ""


def test_every_engine_is_given_the_prompts_text_as_well_as_its_token_ids() -> None:
    """The three processes take the user's text (the coordinator applies the chat template), the others the ids."""
    from bench.modes import Prompt
    from bench.peers import measure
    from bench.target import Case

    seen: list[Prompt] = []

    class Echo:
        name, engine, dtype = "echo", "echo", "float32"

        def run(self, prompt: Prompt) -> Run:
            seen.append(prompt)
            return run(prompt.token_ids, 1.0, 0.0)

        def close(self) -> None:
            pass

    runs, error = measure([Echo()], [Case(0, "coding", 121, "Write a loop", [5, 6, 7])], 16)
    assert error == "" and len(runs["echo"]) == 1
    assert (seen[0].text, seen[0].token_ids, seen[0].max_new_tokens) == ("Write a loop", [5, 6, 7], 16)
