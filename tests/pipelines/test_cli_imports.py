"""The CLI's light entry points stay light: `python -m pipelines --help` (and a stage's `--help`) build
every subcommand's parser, and must not load the stack a subcommand needs only when it runs; `status`
reads the registry (MLflow) and nothing of the model or the data checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipelines.config import REPO_ROOT

HEAVY = ("torch", "peft", "mlflow", "great_expectations", "sklearn")
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def modules_after(argv: list[str], out_file, env: dict | None = None) -> tuple[set[str], str]:
    """(the modules loaded, what it printed) by running `python -m pipelines <argv>` to its end, in a
    fresh interpreter."""
    code = f"""
import json, runpy, sys
sys.argv = ["pipelines", *{argv!r}]
try:
    runpy.run_module("pipelines", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    assert exc.code == 0, exc.code
with open({str(out_file)!r}, "w") as f:
    json.dump(sorted(sys.modules), f)
"""
    run = subprocess.run(
        [PYTHON, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return set(json.loads(out_file.read_text())), run.stdout


def top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["status", "--help"], ["serve", "--help"], ["backtest", "--help"], ["promote", "--help"]],
    ids=" ".join,
)
def test_help_loads_no_heavy_library(argv, tmp_path):
    modules, printed = modules_after(argv, tmp_path / "modules.json")
    loaded = top_level(modules)
    assert printed.startswith("usage: python -m pipelines")  # the CLI itself did run
    assert not loaded & set(HEAVY), f"python -m pipelines {' '.join(argv)} imports {sorted(loaded & set(HEAVY))}"


def test_status_reads_the_registry_without_the_model_or_the_data_checks(tmp_path):
    """A registry in a local SQLite file: status runs to its end without a service."""
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    modules, printed = modules_after(["status", "--json"], tmp_path / "modules.json", env)
    loaded = top_level(modules)
    assert json.loads(printed) == [] and "mlflow" in loaded  # it read the (empty) registry
    unwanted = loaded & {"torch", "peft", "great_expectations"}
    assert not unwanted, f"python -m pipelines status imports {sorted(unwanted)}"
