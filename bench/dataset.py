"""The question sets: Spec-Bench, and the project's repetitive workloads; categories, tasks and prompt selection.

Beside Spec-Bench, two workloads of the project's own hold the text that n-gram
drafting should accept in long runs (``data/NOTICE.md``): ``code_edit`` (a
function and a small change to it; the answer repeats most of the code) and
``agent_loop`` (an agent framework's conversation: tool schemas, earlier tool
calls and their results, asked for the next step).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.prompts import CHAT_ROLES

DATA = Path(__file__).parent / "data"
SPEC_BENCH_PATH = DATA / "spec_bench.jsonl"
CODE_EDIT_PATH = DATA / "code_edit.jsonl"
AGENT_LOOP_PATH = DATA / "agent_loop.jsonl"

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

# The six Spec-Bench tasks in leaderboard order; MT-Bench is its eight categories together.
TASKS: dict[str, tuple[str, ...]] = {
    "mt_bench": MT_BENCH_CATEGORIES,
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
CATEGORIES: tuple[str, ...] = tuple(c for members in TASKS.values() for c in members)

SPEC_BENCH = "spec_bench"
# The repetitive workloads and their categories: code edits that change a part in place or insert new text, and
# agent steps whose answer is a tool call or a plain-text answer quoting the tool output. A workload's name stands
# for its categories (``--categories code_edit``) and names its overall row in the report.
WORKLOADS: dict[str, tuple[str, ...]] = {
    "code_edit": ("edit_replace", "edit_insert"),
    "agent_loop": ("agent_call", "agent_summary"),
}
WORKLOAD_CATEGORIES: tuple[str, ...] = tuple(c for members in WORKLOADS.values() for c in members)
# Every name ``bench.run --categories`` takes: Spec-Bench's tasks and the workloads.
ALL_TASKS: dict[str, tuple[str, ...]] = {**TASKS, **WORKLOADS}
# A tool's result as the user turn it is sent as (the coordinator's CHAT_ROLES have no tool role).
TOOL_RESULT = "Tool result ({name}):\n{content}"
CODE_EDIT_REQUEST = "Reply with the complete updated code in one code block; change nothing else."


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    text: str  # the (first) user turn; Spec-Bench's later turns are not used
    # The whole conversation as (role, content) turns where it is more than ``text`` (an agent loop); empty: one
    # user turn, ``text``.
    turns: tuple[tuple[str, str], ...] = ()

    def messages(self) -> tuple[tuple[str, str], ...]:
        """The conversation the model is asked to continue, as the coordinator receives it."""
        return self.turns or (("user", self.text),)


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def load_questions(path: Path = SPEC_BENCH_PATH) -> list[Question]:
    return [Question(int(row["question_id"]), row["category"], row["turns"][0]) for row in _rows(path)]


def code_edit_text(row: Mapping[str, Any]) -> str:
    """A code-edit prompt: the instruction, the code in a fenced block, and the request for all of it back.

    Asking for the whole code (not a diff) is what makes the answer repeat the prompt, the case n-gram drafting
    is meant for.
    """
    return f"{row['instruction']}\n\n```{row['language']}\n{row['code']}```\n\n{CODE_EDIT_REQUEST}"


def load_code_edits(path: Path = CODE_EDIT_PATH) -> list[Question]:
    return [Question(int(row["question_id"]), row["category"], code_edit_text(row)) for row in _rows(path)]


def chat_turn(message: Mapping[str, str]) -> tuple[str, str]:
    """A message of an agent conversation as a (role, content) turn the coordinator accepts.

    The packaged model's chat template and the coordinator know no ``tool`` role, so a tool's result is sent as
    a user turn that says which tool it came from, as agent frameworks do for models without tool roles.
    """
    if message["role"] == "tool":
        return "user", TOOL_RESULT.format(name=message["name"], content=message["content"])
    if message["role"] not in CHAT_ROLES:
        raise ValueError(f"unknown role {message['role']!r} in an agent conversation")
    return message["role"], message["content"]


def load_agent_loops(path: Path = AGENT_LOOP_PATH) -> list[Question]:
    """The agent conversations; a question's text is the user's task (its first user turn)."""
    questions = []
    for row in _rows(path):
        turns = tuple(chat_turn(message) for message in row["messages"])
        task = next(content for role, content in turns if role == "user")
        questions.append(Question(int(row["question_id"]), row["category"], task, turns))
    return questions


def load_all_questions() -> list[Question]:
    """Spec-Bench's questions and the repetitive workloads' (question ids do not overlap)."""
    return [*load_questions(), *load_code_edits(), *load_agent_loops()]


def workload_of(category: str) -> str:
    """The workload a category belongs to: ``spec_bench`` or one of ``WORKLOADS``."""
    return next((name for name, members in WORKLOADS.items() if category in members), SPEC_BENCH)


def expand_categories(names: Iterable[str], tasks: Mapping[str, tuple[str, ...]] = TASKS) -> list[str]:
    """Category names, where a task name (``mt_bench``; with ``tasks=ALL_TASKS`` also ``code_edit``) stands for
    its categories; names that are not ``tasks``' raise."""
    known = [c for members in tasks.values() for c in members]
    expanded: list[str] = []
    for name in names:
        members = tasks.get(name, (name,))
        for category in members:
            if category not in known:
                raise ValueError(f"unknown category {category!r}; choose from {', '.join([*tasks, *known])}")
            if category not in expanded:
                expanded.append(category)
    return expanded


def select(
    questions: Sequence[Question], categories: Sequence[str], per_category: int, skip: int = 0
) -> list[Question]:
    """``per_category`` questions of each category after its first ``skip``, round-robin over categories.

    Round-robin order spreads slow machine drift (and a run cut short) over
    every category instead of concentrating it on the last ones.
    """
    by_category = {c: [q for q in questions if q.category == c][skip : skip + per_category] for c in categories}
    rounds = itertools.zip_longest(*by_category.values())
    return [q for row in rounds for q in row if q is not None]
