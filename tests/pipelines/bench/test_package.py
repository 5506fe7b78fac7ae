"""The bench package's wiring: its modules import each other without a cycle, the entry points the CLI
and `make bench` use exist, and the validation benchmark runs on a small lake."""

from __future__ import annotations

import ast
import graphlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import pipelines.bench
from pipelines.bench.validation import bench_validation

BENCH_DIR = Path(pipelines.bench.__file__).parent
# (module, what `python -m pipelines bench <name>` and `make bench` call in it)
ENTRY_POINTS = (
    ("training", "run"),
    ("serving", "run"),
    ("validation", "bench_validation"),
    ("families", "run"),
    ("__main__", "main"),
)


def _bench_imports() -> dict[str, set[str]]:
    """{module of pipelines.bench: the modules of pipelines.bench it imports, at any depth of its code}."""
    graph: dict[str, set[str]] = {}
    for path in BENCH_DIR.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "pipelines.bench":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipelines.bench."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("pipelines.bench.")}
        graph[path.stem] = deps
    return graph


def test_bench_modules_import_each_other_without_a_cycle():
    graph = _bench_imports()
    assert "backtest_protocol" in graph["backtest_lr"]  # the parser sees imports: the check below is not vacuous
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a loop


@pytest.mark.parametrize("module, attr", ENTRY_POINTS)
def test_entry_points_import(module, attr):
    assert callable(getattr(importlib.import_module(f"pipelines.bench.{module}"), attr))


def test_make_bench_driver_help():
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.bench", "--help"],
        capture_output=True,
        text=True,
        cwd=BENCH_DIR.parents[1],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--write" in proc.stdout and "--rows" in proc.stdout


def test_validation_benchmark_on_a_small_lake():
    r = bench_validation(rows=2000, reference_days=2)
    assert r["rows"] == 2000 and r["reference_rows"] == 4000 and r["valid"] is True
    assert r["expectations"] > 0 and r["drift_checks"] > 0 and r["validate_s"] >= 0
