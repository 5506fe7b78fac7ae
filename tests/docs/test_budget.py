"""The docs stay a reference a newcomer can read: README.md fits on a screen or two, and README.md plus
docs/ holds at most 15,000 words. docs/history.md, where superseded figures go, is outside the budget."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 120
WORD_BUDGET = 15_000
OUTSIDE_THE_BUDGET = {"history.md"}


def budgeted_docs() -> list[Path]:
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in OUTSIDE_THE_BUDGET]
    return [REPO / "README.md", *docs]


def words(path: Path) -> int:
    return len(path.read_text().split())


def test_readme_is_at_most_120_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_and_docs_stay_within_the_word_budget():
    counts = {p.relative_to(REPO).as_posix(): words(p) for p in budgeted_docs()}
    total = sum(counts.values())
    assert total <= WORD_BUDGET, f"{total} words (at most {WORD_BUDGET}; history.md excluded): {counts}"


def test_the_budget_counts_every_doc_but_history():
    """A budget that silently skipped a file (or counted history) would pass while the docs grew."""
    names = {p.name for p in budgeted_docs()}
    assert {"README.md", "architecture.md", "runbook.md", "benchmarks.md", "cold_start.md"} <= names
    assert "history.md" not in names
    assert all(words(p) > 0 for p in budgeted_docs())
