"""The docs hold together: every relative link and anchor resolves, the README stays a front door, and code comments
cite no benchmark runs (they rot)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(target)
    assert broken == []


def test_the_anchor_rule_is_githubs():
    assert "threads-and-a-shared-cpu" in anchors(ROOT / "docs" / "performance.md")
    assert "gpu" in anchors(ROOT / "BENCHMARKS.md")


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    assert "make demo" in "\n".join(lines[:20]) and "make test" in "\n".join(lines[:20])


def test_code_comments_cite_no_runs():
    found = subprocess.run(["git", "grep", "-nE", r"(#|//).*\bruns? [A-Z]{1,2}[0-9]*\b", "--", "*.py", "*.cpp"],
                           capture_output=True, text=True, cwd=ROOT).stdout
    assert found == ""


README_CELL_MAX = 200


def table_cells(page: Path) -> list[str]:
    """Every cell of every Markdown table on a page, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    rows = [line.strip() for line in text.splitlines() if line.lstrip().startswith("|")]
    return [cell.strip() for row in rows if not re.fullmatch(r"[|\-: ]+", row) for cell in row.strip("|").split("|")]


def test_readme_cells_are_short():
    """A README cell is a phrase or one sentence; the detail is one link away, in docs/ or BENCHMARKS.md."""
    long = [cell for cell in table_cells(ROOT / "README.md") if len(cell) > README_CELL_MAX]
    assert long == []


def test_benchmarks_hold_the_current_state_not_a_log():
    """BENCHMARKS.md names no commits: a figure's provenance is its command and date; past runs live in git history."""
    hashes = re.findall(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", (ROOT / "BENCHMARKS.md").read_text())
    assert hashes == []
