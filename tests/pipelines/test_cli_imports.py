"""The CLI's light entry points stay light: `python -m pipelines --help` (and a stage's `--help`) build
every subcommand's parser, and must not load the stack a subcommand needs only when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines.config import REPO_ROOT

HEAVY = ("torch", "peft", "mlflow", "great_expectations", "sklearn")
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def modules_after(argv: list[str], out_file) -> set[str]:
    """The modules loaded by running `python -m pipelines <argv>` to its end, in a fresh interpreter."""
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
    run = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout  # it really printed the help
    return set(json.loads(out_file.read_text()))


def top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["status", "--help"], ["serve", "--help"], ["backtest", "--help"], ["promote", "--help"]],
    ids=" ".join,
)
def test_help_loads_no_heavy_library(argv, tmp_path):
    loaded = top_level(modules_after(argv, tmp_path / "modules.json"))
    assert "pipelines" in loaded  # the CLI itself did run
    assert not loaded & set(HEAVY), f"python -m pipelines {' '.join(argv)} imports {sorted(loaded & set(HEAVY))}"
