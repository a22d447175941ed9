"""The documentation as a reader meets it: every link resolves inside the repository (a file that exists, a
heading that exists), and reference pages carry no history (work periods, commit hashes, issue numbers:
those belong in CHANGELOG.md and the commit log)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([*REPO.glob("docs/**/*.md"), REPO / "README.md", REPO / "CONTRIBUTING.md"])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HISTORY = re.compile(r"\b(session[- ]\d+|issue #?\d+|#\d{2,3}\b|commit [0-9a-f]{7,40}|[0-9a-f]{7,12} \(commit\))",
                     re.IGNORECASE)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    problems = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if REPO not in dest.parents and dest != REPO:
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_carries_history_markers(page):
    text = page.read_text()
    assert HISTORY.findall(text) == []
    assert "../shared" not in text  # the developers' notes are not in the repository
