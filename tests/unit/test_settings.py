"""Settings declared once (specserve.settings): the parser, the environment fallbacks, the checks and the docs
tables all come from the declarations, and docs/configuration.md cannot drift from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from coordinator.config import CoordinatorConfig
from draft_service.config import DrafterConfig
from specserve import settings
from specserve.service_main import ProcessSettings, ServiceConfig
from specserve.settings import add_settings, declared, markdown_table, render_document, setting, values_from
from target_service.config import VerifierConfig

TIERS = (CoordinatorConfig, DrafterConfig, VerifierConfig)


@dataclass(frozen=True)
class Toy:
    name: str = setting("a", "a name", env="SPECSERVE_TOY_NAME")
    size: int = setting(4, "a size", env="SPECSERVE_TOY_SIZE", minimum=1)
    path: str | None = setting(None, "a path", shown="nowhere")
    limit: int | None = setting(None, "a limit")
    kinds: tuple[str, ...] = setting(("x", "y"), "kinds", choices=("x", "y", "z"))
    mode: str = setting("auto", "a mode", env="SPECSERVE_TOY_MODE", choices=("auto", "off"))
    fast: bool = setting(True, "go fast | or not", env="SPECSERVE_TOY_FAST", flags=("--fast", "--quick"))


def parse(argv: list[str]) -> Toy:
    parser = argparse.ArgumentParser(prog="toy")
    add_settings(parser, Toy)
    return Toy(**values_from(Toy, parser.parse_args(argv)))


@pytest.fixture(autouse=True)
def no_toy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPECSERVE_TOY_NAME", "SPECSERVE_TOY_SIZE", "SPECSERVE_TOY_MODE", "SPECSERVE_TOY_FAST"):
        monkeypatch.delenv(name, raising=False)


def test_an_empty_command_line_gives_the_declared_defaults() -> None:
    assert parse([]) == Toy()


def test_flags_win_over_the_environment_which_wins_over_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_TOY_SIZE", "7")
    monkeypatch.setenv("SPECSERVE_TOY_FAST", "off")
    assert (parse([]).size, parse([]).fast) == (7, False)
    assert (parse(["--size", "9", "--quick"]).size, parse(["--fast"]).fast) == (9, True)
    toy = parse(["--path", "p", "--limit", "3", "--kinds", "z, x", "--no-fast"])
    assert (toy.path, toy.limit, toy.kinds, toy.fast) == ("p", 3, ("z", "x"), False)
    assert parse(["--path", "", "--limit", ""]).limit is None


@pytest.mark.parametrize(
    ("argv", "environment", "says"),
    [
        (["--size", "0"], {}, "--size must be at least 1"),
        (["--kinds", "x,w"], {}, "--kinds w: choose from x, y, z"),
        ([], {"SPECSERVE_TOY_MODE": "fast"}, "--mode fast: choose from auto, off"),
        ([], {"SPECSERVE_TOY_SIZE": "many"}, "SPECSERVE_TOY_SIZE='many'"),
        ([], {"SPECSERVE_TOY_FAST": "maybe"}, "SPECSERVE_TOY_FAST='maybe'"),
    ],
)
def test_a_value_outside_its_declaration_is_refused_with_the_flag_or_variable_named(
    argv: list[str],
    environment: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser(prog="toy")
    try:
        add_settings(parser, Toy)  # a variable that does not parse: the usage line, at once
        values_from(Toy, parser.parse_args(argv))  # a value outside choices or bounds: ValueError for the caller
    except ValueError as exc:
        assert says in str(exc)
    except SystemExit:
        assert says in capsys.readouterr().err
    else:
        pytest.fail(f"{argv} {environment} was accepted")


def test_the_table_shows_flags_variables_defaults_and_choices() -> None:
    table = markdown_table([Toy]).splitlines()
    assert table[0] == "| flag | env | default | meaning |"
    assert "| `--size` | `SPECSERVE_TOY_SIZE` | 4 | a size (at least 1) |" in table
    assert "| `--path` |  | nowhere | a path |" in table
    assert "| `--kinds` |  | `x,y` | kinds (one of `x`, `y`, `z`) |" in table
    fast = "| `--fast` (or `--quick`) / `--no-fast` / `--no-quick` | `SPECSERVE_TOY_FAST` | on | go fast \\| or not |"
    assert fast in table


def test_a_tier_table_leaves_the_common_settings_to_their_table_but_for_the_port() -> None:
    common = {item.name for item in declared(ServiceConfig)}
    for tier in TIERS:
        own = {item.name for item in declared(tier, own=True)}
        assert own & common == {"port"}, tier.__name__  # the port's default is the tier's own


def test_every_setting_has_help_and_a_specserve_variable_and_no_flag_is_declared_twice() -> None:
    for tier in TIERS:
        items = [*declared(tier), *declared(ProcessSettings)]
        flags = [flag for item in items for flag in item.flags]
        assert len(flags) == len(set(flags)), tier.__name__
        for item in items:
            assert item.setting.help.strip(), (tier.__name__, item.name)
            assert item.setting.env is None or item.setting.env.startswith("SPECSERVE_"), item.name


def test_render_document_fills_each_block_and_leaves_the_rest() -> None:
    text = "# T\n\n<!-- settings: toy:Toy -->\nstale\n<!-- /settings -->\n\nprose\n"
    rendered = render_document(text, load=lambda name: Toy)
    assert rendered.startswith("# T\n\n<!-- settings: toy:Toy -->\n| flag |")
    assert rendered.endswith("|\n<!-- /settings -->\n\nprose\n")
    assert render_document(rendered, load=lambda name: Toy) == rendered


def test_docs_configuration_is_generated_from_the_declarations() -> None:
    """Fails when a setting changed and docs/configuration.md was not rewritten (the fix is in the message)."""
    text = settings.DOCUMENT.read_text()
    assert text.count("<!-- settings: ") == 4
    assert render_document(text) == text, "docs/configuration.md is out of date with the settings: run make docs"
    assert settings.main(["--check"]) == 0
