"""Settings declared once: each field of a config dataclass carries its flag, environment variable, help and bounds.

The rule: a service's settings are the fields of its config dataclass, each declared with ``setting(...)``. The
command line (argparse, every flag with its environment fallback), the check of choices and bounds, and the
tables of docs/configuration.md are all made from those declarations. The reason: a default, a flag name, an
environment variable or a help text typed twice drifts, and a deployment that sets the variable the document
names must get what the code reads.

``python -m specserve.settings --markdown`` rewrites the tables of docs/configuration.md; ``--check`` only says
whether they are current (a unit test runs it). Each table is a block of that file between
``<!-- settings: MODULE:CLASS ... -->`` and ``<!-- /settings -->``: the document names the dataclasses it shows,
so this module, shared by every tier, imports none of them by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METADATA_KEY = "specserve.setting"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
"""How an environment variable spells a switch; any other word is refused with the variable's name."""


@dataclass(frozen=True)
class Setting:
    """What a config field declares besides its type and default (see ``setting``)."""

    help: str
    env: str | None = None
    flags: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    shown: str | None = None
    group: str | None = None


def setting(
    default: Any,
    help: str,
    *,
    env: str | None = None,
    flags: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    minimum: float | None = None,
    shown: str | None = None,
    group: str | None = None,
) -> Any:
    """A dataclass field that is also a setting.

    ``flags``: the command-line names, ``--field-name`` when empty (the first is the one documented).
    ``env``: the environment variable that replaces the default when set. ``choices`` (for a tuple field: of
    each item) and ``minimum`` are checked whether the value came from a flag, the environment or the default.
    ``shown``: the default as the documents write it, where the value itself would mislead (a path of this
    machine) or say nothing (None). ``group``: the --help section.
    """
    declared = Setting(help, env, tuple(flags), tuple(choices) if choices is not None else None, minimum, shown, group)
    return field(default=default, metadata={METADATA_KEY: declared})


@dataclass(frozen=True)
class Declared:
    """One setting of a dataclass: its field, its declaration and what its type reads as."""

    name: str
    default: Any
    setting: Setting
    kind: str
    optional: bool

    @property
    def flags(self) -> tuple[str, ...]:
        return self.setting.flags or ("--" + self.name.replace("_", "-"),)

    def parse_text(self, text: str) -> Any:
        """The value a flag's or environment variable's text stands for (ValueError saying why not)."""
        if self.optional and not text.strip():
            return None
        if self.kind == "bool":
            word = text.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"expected one of {', '.join(w for w in TRUE_WORDS + FALSE_WORDS if w)}")
            return word in TRUE_WORDS
        if self.kind == "tuple":
            return tuple(item.strip() for item in text.split(",") if item.strip())
        return {"str": str, "int": int, "float": float}[self.kind](text)


def flag_default(value: Any) -> Any:
    """A value as argparse holds it before parsing: "" for None, a comma list for a tuple."""
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ",".join(value)
    return value


def optional_int(text: str) -> int | None:
    """An integer setting that may be left unset ("": None)."""
    return int(text) if text.strip() else None


def optional_float(text: str) -> float | None:
    """A number setting that may be left unset ("": None)."""
    return float(text) if text.strip() else None


KINDS = {"str": "str", "int": "int", "float": "float", "bool": "bool", "tuple[str,...]": "tuple"}
NUMBERS: dict[tuple[str, bool], Callable[[str], Any]] = {
    ("int", False): int,
    ("float", False): float,
    ("int", True): optional_int,
    ("float", True): optional_float,
}
"""argparse's ``type`` of each number setting (its name is argparse's word for a bad value: "invalid int value")."""


def declared(cls: type, *, own: bool = False) -> Iterator[Declared]:
    """The settings of dataclass ``cls`` in field order (``own``: only those its dataclass bases do not declare
    with the same default, so that a table of ``cls`` shows what the base's table does not)."""
    inherited: dict[str, Any] = {}
    if own:
        for base in reversed(cls.__mro__[1:]):
            if dataclasses.is_dataclass(base):
                inherited |= {f.name: f.default for f in dataclasses.fields(base)}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(METADATA_KEY)
        if spec is None or (f.name in inherited and inherited[f.name] == f.default):
            continue
        annotation = (f.type.__name__ if isinstance(f.type, type) else str(f.type)).replace(" ", "")
        optional = annotation.endswith("|None")
        kind = KINDS.get(annotation.removesuffix("|None"))
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a setting cannot be of type {f.type}")
        yield Declared(f.name, f.default, spec, kind, optional)


def add_settings(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each setting of ``cls``, whose default is its environment variable's value when set.

    The environment is read now (when main() builds its parser), never at import; a value there that does
    not parse stops the program with the variable's name.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for item in declared(cls):
        spec = item.setting
        target: Any = parser
        if spec.group is not None:
            target = groups.setdefault(spec.group, parser.add_argument_group(spec.group))
        default = item.default
        if spec.env is not None and spec.env in os.environ:
            try:
                default = item.parse_text(os.environ[spec.env])
            except ValueError as exc:
                parser.error(f"{spec.env}={os.environ[spec.env]!r}: {exc}")
        text = spec.help + (f" [env {spec.env}]" if spec.env else "")
        kwargs: dict[str, Any] = {"dest": item.name, "help": text.replace("%", "%%")}
        if item.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = bool(default)
        else:
            kwargs["default"] = flag_default(default)
            if item.kind in ("int", "float"):
                kwargs["type"] = NUMBERS[item.kind, item.optional]
            if item.kind == "str" and spec.choices is not None:
                kwargs["choices"] = spec.choices
        target.add_argument(*item.flags, **kwargs)


def values_from(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed settings of ``cls`` as its fields' values, checked against choices and bounds (ValueError)."""
    values: dict[str, Any] = {}
    for item in declared(cls):
        value = getattr(args, item.name)
        if isinstance(value, str) and item.kind != "str":
            value = item.parse_text(value)
        elif isinstance(value, str) and item.optional and not value:
            value = None
        check(item, value)
        values[item.name] = value
    return values


def check(item: Declared, value: Any) -> None:
    """ValueError naming the flag when ``value`` is outside the setting's choices or bounds."""
    spec, flag = item.setting, item.flags[0]
    if spec.choices is not None and value is not None:
        unknown = [v for v in (value if isinstance(value, tuple) else (value,)) if v not in spec.choices]
        if unknown:
            raise ValueError(f"{flag} {', '.join(map(str, unknown))}: choose from {', '.join(spec.choices)}")
    if spec.minimum is not None and value is not None and value < spec.minimum:
        raise ValueError(f"{flag} must be at least {spec.minimum:g}")


def shown_default(item: Declared) -> str:
    """The default as a table cell."""
    value = item.default
    if item.setting.shown is not None:
        return item.setting.shown
    if item.kind == "bool":
        return "on" if value else "off"
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, tuple):
        return f"`{','.join(value)}`"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown_rows(cls: type) -> list[str]:
    """One table row a setting that ``cls`` declares itself (its dataclass bases' settings have their table)."""
    rows = []
    for item in declared(cls, own=True):
        spec = item.setting
        flags = " (or ".join(f"`{f}`" for f in item.flags) + (")" if len(item.flags) > 1 else "")
        if item.kind == "bool":
            flags += " / " + " / ".join(f"`--no-{f.removeprefix('--')}`" for f in item.flags)
        meaning = spec.help
        if spec.choices is not None:
            meaning += f" (one of {', '.join(f'`{c}`' for c in spec.choices)})"
        if spec.minimum is not None:
            meaning += f" (at least {spec.minimum:g})"
        cells = [flags, f"`{spec.env}`" if spec.env else "", shown_default(item), meaning]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def markdown_table(classes: Sequence[type]) -> str:
    head = ["| flag | env | default | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join(head + [row for cls in classes for row in markdown_rows(cls)])


BLOCK = re.compile(r"(<!-- settings: (?P<names>[^>]*?) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.DOTALL)


def resolve(name: str) -> type:
    """``module:Class`` to the class (names come from the document, so this module names no tier)."""
    module, _, attribute = name.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    if not dataclasses.is_dataclass(found) or not isinstance(found, type):
        raise TypeError(f"{name} is not a dataclass")
    return found


def render_document(text: str, load: Callable[[str], type] = resolve) -> str:
    """``text`` with every settings block's table made anew from the dataclasses it names."""

    def table(match: re.Match[str]) -> str:
        classes = [load(name) for name in match["names"].split()]
        return f"{match.group(1)}{markdown_table(classes)}\n{match.group(4)}"

    return BLOCK.sub(table, text)


DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.settings", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="rewrite the settings tables of the document")
    parser.add_argument("--check", action="store_true", help="exit 1 if the document's tables are out of date")
    parser.add_argument("document", nargs="?", type=Path, default=DOCUMENT)
    args = parser.parse_args(argv)
    if not (args.markdown or args.check):
        parser.error("pass --markdown (rewrite) or --check")
    text = args.document.read_text()
    rendered = render_document(text)
    if args.check:
        if rendered != text:
            print(
                f"{args.document} is out of date: run make docs (python -m specserve.settings --markdown)",
                file=sys.stderr,
            )
            return 1
        return 0
    if rendered != text:
        args.document.write_text(rendered)
        print(f"rewrote the settings tables of {args.document}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
