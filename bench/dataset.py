"""The Spec-Bench question set: categories, tasks and prompt selection."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SPEC_BENCH_PATH = Path(__file__).parent / "data" / "spec_bench.jsonl"

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


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    text: str  # the first turn; Spec-Bench's later turns are not used


def load_questions(path: Path = SPEC_BENCH_PATH) -> list[Question]:
    questions = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                questions.append(Question(int(row["question_id"]), row["category"], row["turns"][0]))
    return questions


def expand_categories(names: Iterable[str]) -> list[str]:
    """Category names, where a task name (``mt_bench``) stands for its categories; unknown names raise."""
    expanded: list[str] = []
    for name in names:
        members = TASKS.get(name, (name,))
        for category in members:
            if category not in CATEGORIES:
                raise ValueError(f"unknown category {category!r}; choose from {', '.join([*TASKS, *CATEGORIES])}")
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
