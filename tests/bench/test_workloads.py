"""The repetitive workloads beside Spec-Bench: their data, their categories, and one prompt of each through bench.run.

The data checks need no model. The smoke run (the packaged target, float32, greedy) runs one code edit and one
agent conversation through ``baseline`` and ``inproc:prompt_lookup`` (the cheapest speculative mode: no draft head
to load) for 8 tokens, and checks that the agent's whole conversation reached the model, that speculative output
equals plain decoding token for token, and that each workload has rows of its own. Never how fast anything is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import run
from bench.aggregate import OVERALL, groups_of
from bench.dataset import (
    ALL_TASKS,
    CATEGORIES,
    CHAT_ROLES,
    CODE_EDIT_REQUEST,
    WORKLOADS,
    Question,
    chat_turn,
    expand_categories,
    load_agent_loops,
    load_all_questions,
    load_code_edits,
    load_questions,
)
from bench.target import load_target_text, turns_ids

CODE_EDIT_ROWS = Path(run.__file__).parent / "data" / "code_edit.jsonl"
SMOKE_CATEGORIES = ("edit_replace", "agent_call")
SMOKE_MODES = ("baseline", "inproc:prompt_lookup")
MAX_NEW_TOKENS = 8


def test_code_edits_hold_a_function_an_instruction_and_the_request_for_all_of_it() -> None:
    questions = load_code_edits()
    assert 16 <= len(questions) <= 24
    assert {q.category for q in questions} == set(WORKLOADS["code_edit"])
    rows = [json.loads(line) for line in CODE_EDIT_ROWS.read_text().splitlines() if line.strip()]
    for question, row in zip(questions, rows, strict=True):
        assert set(row) == {"question_id", "category", "language", "instruction", "code"}
        assert 15 <= len(row["code"].splitlines()) <= 60, question.question_id
        assert question.text.startswith(row["instruction"]) and question.text.endswith(CODE_EDIT_REQUEST)
        assert f"```{row['language']}\n{row['code']}```" in question.text
        assert question.turns == () and question.messages() == (("user", question.text),)


def test_agent_loops_repeat_tool_calls_and_results_in_the_context() -> None:
    questions = load_agent_loops()
    assert 12 <= len(questions) <= 16
    assert {q.category for q in questions} == set(WORKLOADS["agent_loop"])
    for question in questions:
        roles = [role for role, _ in question.turns]
        assert roles[:2] == ["system", "user"] and set(roles) <= set(CHAT_ROLES), question.question_id
        assert question.text == question.turns[1][1]  # the user's task
        assert question.messages() == question.turns
        schemas = [json.loads(line) for line in question.turns[0][1].splitlines() if line.startswith("{")]
        assert schemas and all({"name", "description", "parameters"} <= set(schema) for schema in schemas)
        calls = [json.loads(content) for role, content in question.turns if role == "assistant"]
        assert calls and all(set(call) == {"tool", "arguments"} for call in calls)
        assert {call["tool"] for call in calls} <= {schema["name"] for schema in schemas}
        results = [content for role, content in question.turns if content.startswith("Tool result (")]
        assert len(results) == len(calls), question.question_id


def test_a_tool_result_becomes_a_user_turn_naming_its_tool() -> None:
    assert chat_turn({"role": "tool", "name": "read_file", "content": "1  x = 1"}) == (
        "user",
        "Tool result (read_file):\n1  x = 1",
    )
    assert chat_turn({"role": "assistant", "content": "{}"}) == ("assistant", "{}")
    with pytest.raises(ValueError, match="unknown role"):
        chat_turn({"role": "function", "content": "{}"})


def test_question_ids_are_unique_across_the_question_sets() -> None:
    questions = load_all_questions()
    assert len({q.question_id for q in questions}) == len(questions)
    assert len(questions) == len(load_questions()) + len(load_code_edits()) + len(load_agent_loops())


def test_a_workload_name_stands_for_its_categories() -> None:
    assert expand_categories(["edit_insert", "code_edit", "mt_bench"], ALL_TASKS)[:3] == [
        "edit_insert",
        "edit_replace",
        "writing",
    ]


def test_other_harnesses_keep_to_spec_bench() -> None:
    with pytest.raises(ValueError, match="unknown category 'code_edit'"):
        expand_categories(["code_edit"])


def test_bench_run_takes_the_workloads_and_keeps_spec_bench_as_its_default(packaged_model: None) -> None:
    categories = run.parse_args(["--categories", "code_edit,agent_loop"]).categories
    assert categories == [*WORKLOADS["code_edit"], *WORKLOADS["agent_loop"]]
    assert run.parse_args(["--categories", "mt_bench,agent_call"]).categories[-1] == "agent_call"
    assert run.parse_args([]).categories == list(CATEGORIES)


def test_each_workload_has_an_overall_of_its_own_apart_from_spec_bench() -> None:
    groups = dict(groups_of(["writing", "edit_insert", "agent_call", "agent_summary"]))
    assert groups[OVERALL] == ["writing"]
    assert groups["code_edit"] == ["edit_insert"]
    assert groups["agent_loop"] == ["agent_call", "agent_summary"]
    assert OVERALL not in dict(groups_of(["agent_call"]))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, packaged_model: None) -> tuple[dict[str, Any], str]:
    """One prompt of each workload through bench.run: its JSON document and its Markdown report."""
    out = tmp_path_factory.mktemp("bench-workloads")
    argv = ["--dtype", "float32", "--modes", ",".join(SMOKE_MODES), "--categories", ",".join(SMOKE_CATEGORIES)]
    argv += ["--prompts-per-category", "1", "--max-new-tokens", str(MAX_NEW_TOKENS), "--redis-url", ""]
    code = run.main([*argv, "--no-progress", "--out-dir", str(out)])
    assert code == 0, "the harness stopped early; see its stderr"
    return json.loads((out / "spec_bench.json").read_text()), (out / "spec_bench.md").read_text()


def first_of(category: str) -> Question:
    return next(q for q in load_all_questions() if q.category == category)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_one_prompt_of_each_workload_runs_and_speculation_equals_plain_decoding(
    smoke: tuple[dict[str, Any], str],
) -> None:
    result, _ = smoke
    assert result["meta"]["complete"] and result["meta"]["settings"]["workloads"] == ["code_edit", "agent_loop"]
    records = result["records"]
    assert sorted((r["mode"], r["category"]) for r in records) == sorted(
        (mode, category) for mode in SMOKE_MODES for category in SMOKE_CATEGORIES
    )
    tokenizer = load_target_text("smollm2").tokenizer
    agent = first_of("agent_call")
    for record in records:
        assert record["question_id"] == first_of(record["category"]).question_id
        assert 1 <= record["tokens"] <= MAX_NEW_TOKENS
        assert record["identical"] is True, record  # float32, greedy: token for token
        if record["category"] == "agent_call":  # the whole conversation, not the task alone
            assert record["prompt_tokens"] == len(turns_ids(tokenizer, agent.turns))


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_each_workload_has_rows_of_its_own_in_the_report(smoke: tuple[dict[str, Any], str]) -> None:
    result, report = smoke
    groups = {(s["mode"], s["group"]) for s in result["summaries"]}
    expected = {"edit_replace", "code_edit", "agent_call", "agent_loop"}
    assert groups == {(mode, group) for mode in SMOKE_MODES for group in expected}
    for workload in ("code_edit", "agent_loop"):
        (category,) = (c for c in SMOKE_CATEGORIES if c in WORKLOADS[workload])
        rows = {s["mode"]: s for s in result["summaries"] if s["group"] in (workload, category)}
        assert rows["baseline"]["speedup"] == 1.0 and rows["baseline"]["tau"] == 1.0
        assert rows["inproc:prompt_lookup"]["identical"] == rows["inproc:prompt_lookup"]["compared"] == 1
    assert report.startswith("# specserve on Code edit, Agent loop\n")
    assert "## Code edit (`code_edit`): speedup / τ" in report and "## Agent loop (`agent_loop`)" in report
    assert "### Agent loop: all figures" in report and "Spec-Bench leaderboard" not in report
