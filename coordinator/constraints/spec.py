"""What a request asks its output to match, and the checks that need no grammar engine."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum

from specserve.errors import InvalidArgument


class ConstraintKind(Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK_GRAMMAR = "lark_grammar"
    CHOICE = "choice"


@dataclass(frozen=True)
class ConstraintLimits:
    max_bytes: int = 64 * 1024  # a schema, regex or grammar's text (all choices together for a choice)
    max_choices: int = 1024
    compile_timeout_s: float = 5.0


@dataclass(frozen=True)
class Constraint:
    """One constraint: ``text`` holds the schema (JSON text), regex or Lark grammar; ``choices`` a choice's strings."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    digest: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        payload = json.dumps([self.kind.value, self.text, list(self.choices)], ensure_ascii=False)
        object.__setattr__(self, "digest", hashlib.sha256(payload.encode()).hexdigest())

    @staticmethod
    def json_schema(schema: object) -> Constraint:
        """From a parsed schema (the OpenAI API's ``response_format``), properties in their order (the output
        follows it)."""
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))

    def check(self, limits: ConstraintLimits) -> None:
        """The checks that need no grammar engine; raises InvalidArgument naming the problem."""
        name = self.kind.value
        size = len(self.text.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > limits.max_bytes:
            raise InvalidArgument(f"{name} is {size} bytes; the limit is {limits.max_bytes}")
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                raise InvalidArgument("choice needs at least one string")
            if len(self.choices) > limits.max_choices:
                raise InvalidArgument(f"choice has {len(self.choices)} strings; the limit is {limits.max_choices}")
            if any(not c for c in self.choices):
                raise InvalidArgument("choice strings must be non-empty")
        elif not self.text.strip():
            raise InvalidArgument(f"{name} is empty")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"json_schema is not valid JSON: {exc.msg} at character {exc.pos}") from exc
            if not isinstance(schema, dict | bool):
                raise InvalidArgument("json_schema must be a JSON object (or true/false)")
