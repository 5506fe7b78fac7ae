"""README.md and docs/ point only at what exists: every relative Markdown link resolves to a file (and its
#anchor to a heading there), and every backticked repository path (`pipelines/…`, `tests/…`, …) is a file
or folder of this checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("dags", "plugins", "pipelines", "tests", "docs", "scripts", "configs", "docker", ".ci", "research")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# a repository path: starts at a top-level folder; a trailing `:symbol`, `::test` or `#Lnn` names a place inside
PATH = re.compile(rf"^(?:{'|'.join(re.escape(t) for t in TOP)})/[\w./*-]*$")
# the layers of pipelines/, which the docs name without the prefix (`registry/runs.py`)
LAYERS = tuple(p.name for p in (REPO / "pipelines").iterdir() if (p / "__init__.py").exists())
IN_PIPELINES = re.compile(rf"^(?:{'|'.join(LAYERS)})/[\w./-]*\.py$")


def anchors(doc: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def relative_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if not re.match(r"^[a-z]+:", t)]


def repo_paths(doc: Path) -> list[str]:
    found = []
    for token in CODE.findall(doc.read_text()):
        path = re.split(r"::|:(?=[A-Za-z_])|#", token)[0].rstrip(".,;")
        if path.startswith("../"):
            found.append(path)  # outside the checkout: never there for a reader of the repository
        elif PATH.match(path) and "*" not in path and "<" not in path:
            found.append(path)
        elif IN_PIPELINES.match(path):
            found.append(f"pipelines/{path}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == [], f"{doc.relative_to(REPO)}: links to nothing: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_backticked_repository_path_exists(doc):
    missing = sorted({p for p in repo_paths(doc) if p.startswith("../") or not (REPO / p).exists()})
    assert missing == [], f"{doc.relative_to(REPO)}: names paths that do not exist: {missing}"


def test_the_checks_see_links_and_paths(tmp_path):
    """The two readers above find what they must (a reader that finds nothing passes everything)."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "See [the runbook](docs/runbook.md#serving) and `pipelines/registry/runs.py:tag_run`, "
        "`tests/e2e/test_stack.py::test_x`, `promotion/gate.py`, `../elsewhere.md`, not `make test`, "
        "`lineage/data.json` (an artifact), `s3://b/k` or [web](https://x.org).\n"
    )
    assert relative_links(doc) == ["docs/runbook.md#serving"]
    assert repo_paths(doc) == [
        "pipelines/registry/runs.py",
        "tests/e2e/test_stack.py",
        "pipelines/promotion/gate.py",
        "../elsewhere.md",
    ]
