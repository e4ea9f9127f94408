"""The docs hold together: every relative link and anchor in README.md and docs/ resolves, and
every guide (docs/*.md) stays a short guide; studies go to the dated results log
(docs/results/), which no length limit applies to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+ (.*)", line)):
            found.add(slug(m.group(1)))
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    return broken


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_guide_is_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= GUIDE_LINES, (f"{path.name} has {lines} lines: move its studies into a "
                                  "dated file of docs/results/ and link it")


def test_a_broken_link_and_a_missing_heading_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [gone](b.md) [no](a.md#nothing)\n")
    assert broken_links(tmp_path / "a.md") == ["b.md (no such file)",
                                               "a.md#nothing (no such heading)"]
