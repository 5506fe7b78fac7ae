"""The research package's wiring: its modules import each other without a cycle and each answers a command
(`python -m research.<module>`, research/README.md)."""

from __future__ import annotations

import ast
import graphlib
import importlib
from pathlib import Path

import pytest

import research

RESEARCH_DIR = Path(research.__file__).parent
# (module, what its command or a sibling calls in it)
ENTRY_POINTS = (
    ("quality", "run"),
    ("quality", "main"),
    ("quality_distill", "make_distilled"),
    ("quality_headroom", "run"),
    ("quality_headroom", "main"),
)


def _research_imports() -> dict[str, set[str]]:
    """{module of research: the modules of research it imports, at any depth of its code}."""
    graph: dict[str, set[str]] = {}
    for path in RESEARCH_DIR.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "research":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("research."):
                deps.add(node.module.split(".")[1])
        graph[path.stem] = deps
    return graph


def test_research_modules_import_each_other_without_a_cycle():
    graph = _research_imports()
    # quality imports quality_distill (its CLI's distilled row): the way back would be a cycle
    assert graph["quality_distill"] and "quality" not in graph["quality_distill"]
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a loop


@pytest.mark.parametrize("module, attr", ENTRY_POINTS)
def test_entry_points_import(module, attr):
    assert callable(getattr(importlib.import_module(f"research.{module}"), attr))
