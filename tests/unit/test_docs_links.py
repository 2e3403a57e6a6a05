"""The project's Markdown stands alone: every relative link resolves inside the repository.

For README.md, docs/*.md, bench/README.md and deploy/README.md, each relative link (inline, reference or
image) names a file or folder of the repository that git keeps (not an ignored one such as bench/out/), and
each ``#anchor`` names a heading of its target under GitHub's rules (lowercase, spaces to hyphens,
punctuation dropped, ``-1``, ``-2`` for repeats). No link leaves the repository (``../shared`` and the like)
or starts at ``/``. README.md, docs/ and bench/README.md link to no website either, not even as a bare URL in
prose (code spans and code blocks are examples, not links); deploy/README.md alone may cite http(s) pages,
which the checker does not fetch. The README stays a short page for users: what is long lives in docs/, and
the README links every page there.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 260
# Pages that may link to websites (http and https only); every other checked page links inside the repository.
EXTERNAL_ALLOWED = frozenset({"deploy/README.md"})

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
BARE_URL = re.compile(r"https?://[^\s)>\]]+")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Page:
    """One Markdown file read once: its prose (code blocks blanked) and its headings' anchors."""

    path: Path
    prose: str
    anchors: frozenset[str]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: rendered text, lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def read_page(path: Path) -> Page:
    prose_lines: list[str] = []
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fence = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        opened = FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = ""
            prose_lines.append("")
            continue
        if opened:
            fence = opened.group(1)
            prose_lines.append("")
            continue
        prose_lines.append(line)
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    prose = "\n".join(prose_lines)
    anchors.update(HTML_ANCHOR.findall(prose))
    return Page(path, prose, frozenset(anchors))


def without_code_spans(prose: str) -> str:
    """The prose with inline code replaced by a placeholder, paragraph by paragraph (a span never crosses one)."""
    return "\n\n".join(CODE_SPAN.sub("code", paragraph) for paragraph in re.split(r"\n\s*\n", prose))


def link_targets(prose: str) -> Iterator[str]:
    text = without_code_spans(prose)
    for pattern in (INLINE_LINK, REFERENCE_DEF, AUTOLINK):
        for match in pattern.finditer(text):
            yield match.group(1).strip("<>")


@cache
def kept_by_git() -> frozenset[str] | None:
    """Paths git tracks or would add (ignored ones left out); None where git cannot say (no checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    files = [name for name in listed.decode().split("\0") if name]
    folders = {str(Path(name).parents[i]) for name in files for i in range(len(Path(name).parts) - 1)}
    return frozenset(files) | frozenset(folders)


def problems(path: Path) -> list[str]:
    """Every broken, escaping or forbidden link of one page, each as a line saying what is wrong."""
    name = path.relative_to(ROOT).as_posix()
    page = read_page(path)
    found: list[str] = []
    external_allowed = name in EXTERNAL_ALLOWED
    if not external_allowed:
        found += [f"{name}: a bare URL {url} (README and docs/ link to no website)" for url in bare_urls(page)]
    for target in link_targets(page.prose):
        if SCHEME.match(target):
            if not (external_allowed and target.startswith(("http://", "https://"))):
                found.append(f"{name}: external link {target} (README and docs/ link inside the repository only)")
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            found.append(f"{name}: {target} starts at / (write it relative to {name})")
            continue
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        try:
            relative = resolved.relative_to(ROOT).as_posix()
        except ValueError:
            found.append(f"{name}: {target} leaves the repository")
            continue
        if not resolved.exists():
            found.append(f"{name}: {target} names no file ({relative})")
            continue
        kept = kept_by_git()
        if kept is not None and relative != "." and relative not in kept:
            found.append(f"{name}: {target} names a path git ignores ({relative})")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in read_page(resolved).anchors:
            found.append(f"{name}: {target}: no heading #{anchor} in {relative}")
        elif anchor and resolved.suffix != ".md":
            found.append(f"{name}: {target}: an anchor into {relative}, which is not a Markdown page")
    return found


def bare_urls(page: Page) -> list[str]:
    text = without_code_spans(page.prose)
    for pattern in (INLINE_LINK, REFERENCE_DEF, AUTOLINK):  # links, reported as such
        text = pattern.sub("", text)
    return BARE_URL.findall(text)


def checked_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md"]


@pytest.mark.parametrize("path", checked_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_inside_the_repository(path: Path) -> None:
    found = problems(path)
    assert not found, "\n".join(found)


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (limit {README_MAX_LINES})"


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in link_targets(read_page(README).prose)}
    missing = [p.relative_to(ROOT).as_posix() for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert DOCS.is_dir() and not missing, f"README.md's Read more does not link {missing}"


def test_the_checker_sees_what_github_renders(tmp_path: Path) -> None:
    assert slug("Spec-Bench and llama.cpp tables replaced on 2026-11-29, 02:40 UTC") == (
        "spec-bench-and-llamacpp-tables-replaced-on-2026-11-29-0240-utc"
    )
    assert slug("Repetitive workloads (`make bench-repetitive`)") == "repetitive-workloads-make-bench-repetitive"
    assert slug("9. How the coordinator finds [drafters](x.md)") == "9-how-the-coordinator-finds-drafters"
    page = tmp_path / "page.md"
    page.write_text(
        '# Title\n\n## Title\n\n[a](#title-1) [b](<other page.md> "t")\n`[c](gone.md)` https://x.org\n\n'
        "```\n[d](gone.md)\n# not a heading\n```\n[e]: https://example.org\n",
        encoding="utf-8",
    )
    parsed = read_page(page)
    assert parsed.anchors == {"title", "title-1"}
    assert list(link_targets(parsed.prose)) == ["#title-1", "other page.md", "https://example.org"]
    assert bare_urls(parsed) == ["https://x.org"]
