"""Why llguidance refused a constraint, in our words: the client's message never carries the library's text.

llguidance's messages name the problem well for a developer, but they are its own wording, quote its internal
grammar (a regex is compiled as ``start: /.../``, with positions in that text) and have no bound on length. A
refusal is sorted into a known class here, and the client is told the class in our phrasing. A name is taken
from the library's text only when it is the caller's own input: short, printable, and found in the
constraint's text (a type name, a keyword, a format, an undefined rule). llguidance's whole text goes in the
error's ``detail``, which the request's log line carries under its request id.

``reason`` labels the refusal for the metrics (``specserve_grammar_compile_failures_total``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from coordinator.constraints.spec import Constraint, ConstraintKind
from specserve.errors import InvalidArgument

# The metrics' reason labels, in the order the series are created.
REFUSAL_REASONS = (
    "unknown_type",
    "unsupported_keyword",
    "unknown_format",
    "bad_reference",
    "unsatisfiable",
    "bad_value",
    "regex_syntax",
    "grammar_syntax",
    "too_large",
    "timeout",
    "other",
    "too_few_tokens",  # not the constraint's fault: the request's token limit is below its shortest output
)

JSON_TYPES = "string, number, integer, boolean, object, array and null"
MAX_NAME = 64  # longest name quoted back to the caller
MAX_NAMES = 5  # most names listed in one message

_LOCATION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_SAFE_NAME = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces or control characters

# The regex crate's "error: ..." line, by a phrase it contains, to our words (first match wins).
_REGEX_PROBLEMS = (
    ("look-around", "look-around (lookahead, lookbehind) is not supported"),
    ("lookaround", "look-around (lookahead, lookbehind) is not supported"),
    ("backreference", "backreferences are not supported"),
    ("unclosed group", "a parenthesis is not closed"),
    ("unopened group", "a closing parenthesis has no opening one"),
    ("unclosed character class", "a character class [...] is not closed"),
    ("character class", "a character class is malformed"),
    ("repetition", "a repetition ({n,m}, *, +, ?) is malformed"),
    ("escape", "an escape sequence is not recognised"),
    ("capture group name", "a capture group's name is invalid or used twice"),
    ("unicode", "an unknown Unicode class"),
)
_LIMIT_WORDS = ("too big", "too large", "too many", "limit", "exceed")


class ConstraintRefused(InvalidArgument):
    """INVALID_ARGUMENT for a constraint that cannot be compiled; ``reason`` is one of REFUSAL_REASONS."""

    def __init__(self, message: str, reason: str, detail: str = "") -> None:
        super().__init__(message, detail=detail)
        self.reason = reason


@dataclass(frozen=True)
class _Class:
    reason: str
    message: str  # after "<kind> ", e.g. 'has an unknown type "strin"'


def refused(constraint: Constraint, library_text: str) -> ConstraintRefused:
    """The client's error for llguidance's refusal ``library_text`` (kept whole as the detail, for the log)."""
    found = _classify(constraint.kind, constraint.text, library_text)
    return ConstraintRefused(f"{constraint.kind.value} {found.message}", found.reason, detail=library_text)


def timed_out(constraint: Constraint, seconds: float) -> ConstraintRefused:
    return ConstraintRefused(
        f"{constraint.kind.value} took longer than {seconds:g} s to compile; simplify it", "timeout"
    )


def too_few_tokens(constraint: Constraint, needed: int, max_new_tokens: int) -> ConstraintRefused:
    """A request whose token limit is below the constraint's shortest output: it could only end cut, unmatched."""
    return ConstraintRefused(
        f"max_new_tokens is {max_new_tokens}, but any output that completes this {constraint.kind.value} takes at "
        f"least {needed} tokens; raise max_new_tokens (max_tokens in the OpenAI API)",
        "too_few_tokens",
    )


def _classify(kind: ConstraintKind, text: str, library_text: str) -> _Class:
    message = library_text.strip()
    location = _LOCATION.match(message)
    body = message[location.end() :] if location else message
    first = body.splitlines()[0] if body else ""
    if kind is ConstraintKind.JSON_SCHEMA:
        found = _json_schema(text, body, first)
    elif kind is ConstraintKind.REGEX:
        found = _regex(text, body)
    elif kind is ConstraintKind.LARK_GRAMMAR:
        found = _lark(text, body, first, location)
    else:
        found = None
    if found is not None:
        return found
    if any(word in first.lower() for word in _LIMIT_WORDS):
        return _Class("too_large", "is over the compile limits (grammar size or lexer states); simplify it")
    return _Class("other", "could not be compiled: it uses something this server does not support")


def _json_schema(text: str, body: str, first: str) -> _Class | None:
    if first.startswith("Invalid type:") or first.startswith("type must be"):
        name = _named(first.removeprefix("Invalid type:").strip(), text) if first.startswith("Invalid") else None
        what = f'an unknown type "{name}"' if name else "a type that is not one of the JSON types"
        return _Class("unknown_type", f"has {what}; the types are {JSON_TYPES}")
    if first.startswith("Unimplemented keys:"):
        names = _named_list(first.removeprefix("Unimplemented keys:").strip(), text)
        listed = ", ".join(f'"{n}"' for n in names)
        if not names:
            return _Class("unsupported_keyword", "uses a keyword this server does not support")
        return _Class("unsupported_keyword", f"uses keywords this server does not support: {listed}")
    if first.startswith("Unknown format:"):
        name = _named(first.removeprefix("Unknown format:").strip(), text)
        what = f'an unknown string format "{name}"' if name else "an unknown string format"
        return _Class("unknown_format", f"has {what}")
    if "regex parse error" in body:
        problem = _regex_problem(body)
        return _Class("regex_syntax", f'has a "pattern" that is not a valid regular expression: {problem}')
    if first.startswith("Pointer '") and first.endswith("' does not exist"):
        pointer = _named(first.removeprefix("Pointer '").removesuffix("' does not exist"), text)
        where = f' "#{pointer}"' if pointer else ""
        return _Class("bad_reference", f"has a $ref{where} that points to nothing in the schema")
    if "not present in a registry" in first or "retrieving it failed" in first:
        return _Class("bad_reference", 'has a $ref to another document; only references inside it ("#/...") work')
    if first.startswith("Invalid URI reference"):
        return _Class("bad_reference", "has a $ref that is not a valid URI reference")
    if first.startswith("Unsatisfiable schema"):
        return _Class("unsatisfiable", "allows no value at all: its keywords contradict each other")
    for prefix, marker in (("Expected ", " for '"), ("Value for '", "Value for '")):
        if first.startswith(prefix) and marker in first:
            keyword = _named(first.split(marker, 1)[1].split("'", 1)[0], text)
            where = f'"{keyword}"' if keyword else "a keyword"
            return _Class("bad_value", f"has a value for {where} that this server cannot use")
    return None


def _regex(text: str, body: str) -> _Class | None:
    if "regex parse error" not in body:
        return None
    at = _regex_position(body, text)
    return _Class("regex_syntax", f"is not a valid regular expression{at}: {_regex_problem(body)}")


def _lark(text: str, body: str, first: str, location: re.Match[str] | None) -> _Class | None:
    where = f" at line {location[1]}, column {location[2]}" if location else ""
    if first == "no start rule found":
        return _Class("grammar_syntax", 'has no "start" rule')
    if "regex parse error" in body:
        return _Class("regex_syntax", f"has an invalid regular expression{where}: {_regex_problem(body)}")
    if first.startswith("failed to compile JSON schema:"):
        inner = _json_schema(text, body.split(":", 1)[1].strip(), first.split(":", 1)[1].strip())
        if inner is not None:
            return _Class(inner.reason, f"has a %json schema{where} that {inner.message}")
        return _Class("other", f"has a %json schema{where} that could not be compiled")
    quoted = _QUOTED.search(first)
    name = _named(quoted[1], text) if quoted else None
    if first.startswith("unknown name:"):
        what = f'"{name}"' if name else "a name"
        return _Class("grammar_syntax", f"uses {what}{where}, which no rule or terminal defines")
    if first.startswith("duplicate rule:"):
        what = f'"{name}"' if name else "a rule"
        return _Class("grammar_syntax", f"defines {what} twice{where}")
    if any(word in first.lower() for word in _LIMIT_WORDS):
        return None  # the general size-limit message
    if location:
        return _Class("grammar_syntax", f"has a syntax error{where}")
    return None


def _regex_problem(body: str) -> str:
    """Our words for the regex crate's "error: ..." line."""
    error = next((line for line in body.splitlines() if line.startswith("error: ")), "").lower()
    return next((ours for phrase, ours in _REGEX_PROBLEMS if phrase in error), "a syntax error")


def _regex_position(body: str, text: str) -> str:
    """Where the regex crate's caret points (" at character N"), when its copy of the pattern is the caller's
    (an ASCII pattern on one line: llguidance escapes line breaks, and the caret counts columns, not bytes)."""
    lines = body.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.endswith("regex parse error:"))
        pattern, carets = lines[start + 1], lines[start + 2]
    except (StopIteration, IndexError):
        return ""
    if not text.isascii() or pattern[4:] != text or not carets.strip() or set(carets.strip()) - {"^", " "}:
        return ""
    return f" at character {carets.index('^') - 4 + 1}"


def _named(name: str, text: str) -> str | None:
    """``name`` when it is fit to quote back: short, printable, and part of the caller's own text."""
    if 0 < len(name) <= MAX_NAME and _SAFE_NAME.fullmatch(name) and name in text:
        return name
    return None


def _named_list(listed: str, text: str) -> list[str]:
    try:
        names = json.loads(listed)
    except json.JSONDecodeError:
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names[:MAX_NAMES] if isinstance(n, str) and _named(n, text)]
