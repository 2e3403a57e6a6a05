"""The house's layering, read from the imports (bench/ and tests/ may import anything).

The three tiers (coordinator, draft_service, target_service) are siblings over specserve/: each imports
specserve/ and none imports another; specserve/ imports no tier; the client SDK imports specserve/ alone.
The coordinator runs without torch: importing any of its modules loads none. The verifier's engine runs
without the services' gRPC extras: ``make test-gpu`` runs ``tests/gpu`` on a lent device machine that has
PyTorch and transformers but not grpcio-health-checking or the generated protos.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIERS = ("coordinator", "draft_service", "target_service")
PACKAGES = (*TIERS, "specserve", "client")
# What each package may import among the repository's own packages.
ALLOWED = {
    "coordinator": {"coordinator", "specserve"},
    "draft_service": {"draft_service", "specserve"},
    "target_service": {"target_service", "specserve"},
    "specserve": {"specserve"},
    "client": {"client", "specserve"},
}
OWN = {*PACKAGES, "bench", "tests"}


def sources(package: str) -> Iterator[Path]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.relative_to(ROOT).parts[:2] != ("specserve", "v1"):  # generated stubs
            yield path


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, function-level and TYPE_CHECKING ones included."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(text: str, module: str, is_package: bool = False, members: bool = False) -> Iterator[tuple[int, str]]:
    """``members``: for ``from a import b``, ``a.b`` too (the module ``b`` where ``a`` is a package)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            elif node.module:
                base = node.module
            else:
                continue
            yield node.lineno, base
            if members:
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"


def test_the_sources_are_found() -> None:
    for package in PACKAGES:
        assert len(list(sources(package))) >= 2, package


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_what_its_layer_allows(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sources(package)
        for line, name in imported_modules(path)
        if name.split(".")[0] in OWN and name.split(".")[0] not in ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_reads_absolute_relative_and_nested_imports() -> None:
    text = "import grpc\nfrom . import rounds\nfrom ..specserve import errors\n\n"
    text += "def f():\n    import draft_service.drafter\n"
    names = [name for _, name in imports_in(text, "coordinator.probe")]
    assert sorted(names) == ["coordinator", "draft_service.drafter", "grpc", "specserve"]  # a tier is the first part


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports (TYPE_CHECKING ones included)."""
    paths = {}
    for path in sources(package):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {
        name: {
            imported
            for _, imported in imports_in(path.read_text(), name, path.name == "__init__.py", members=True)
            if imported in paths and imported != name
        }
        for name, path in paths.items()
    }


def a_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph``, its first module repeated at the end; [] where there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        path.append(module)
        for imported in sorted(graph[module]):
            if imported in path:
                return [*path[path.index(imported) :], imported]
            if imported not in done and (circle := visit(imported)):
                return circle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if module not in done and (circle := visit(module)):
            return circle
    return []


def test_the_circle_finder_finds_a_circle_and_only_one() -> None:
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    names = [name for _, name in imports_in("from . import rounds\n", "coordinator.probe", members=True)]
    assert names == ["coordinator", "coordinator.rounds"]


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_s_modules_import_one_another_in_no_circle(package: str) -> None:
    """Imports run one way, from a module to the modules below it: a module that two others read sits below
    both (a protocol where it reads one of them back), so that each can be read, tested and moved alone."""
    graph = import_graph(package)
    assert len(graph) >= 2
    circle = a_circle(graph)
    assert not circle, "these modules import each other in a circle: " + " -> ".join(circle)


def coordinator_modules() -> list[str]:
    import coordinator

    return [
        info.name
        for info in pkgutil.walk_packages(coordinator.__path__, "coordinator.")
        if not info.name.endswith("__main__")  # runs the service
    ]


def test_the_coordinator_imports_no_torch() -> None:
    modules = coordinator_modules()
    assert "coordinator.main" in modules and "coordinator.openai_api.app" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the coordinator's modules load {done.stdout.strip()[:300]}"


def test_the_verifier_engine_imports_without_grpc_health_or_generated_protos() -> None:
    """A subprocess, so that this process's already-imported modules cannot hide a new import."""
    script = (
        "import sys\n"
        "for name in ('grpc_health', 'grpc_reflection', 'specserve.v1'):\n"
        "    sys.modules[name] = None  # importing it now raises ImportError\n"
        "import target_service.verifier, target_service.config, tests.gpu.test_cuda_graphs\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
