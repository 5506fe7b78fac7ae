"""The import contracts of pyproject.toml hold, and each of them fails when it is broken.

The second half is what makes the first worth anything: a copy of the tree gets one forbidden import
per contract, and lint-imports must name that contract as broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd / "plugins")}
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_contract():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kept, 0 broken" in out.stdout, out.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("pipelines", "dags", "research"):
        shutil.copytree(ROOT / d, dst / d, ignore=ignore)
    shutil.copytree(ROOT / "plugins" / "ctr_airflow", dst / "plugins" / "ctr_airflow", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


@pytest.mark.parametrize(
    "path, line, contract",
    [
        # a lower layer reaching up: the model would depend on alias moves
        ("pipelines/model/features.py", "from pipelines.promotion import aliases", "pipelines is a stack of layers"),
        # two stages importing each other
        ("pipelines/evaluation/slices.py", "from pipelines.training import loop", "pipelines is a stack of layers"),
        ("pipelines/registry/integrity.py", "import airflow", "pipelines is plain Python: it never imports Airflow"),
        (
            "plugins/ctr_airflow/runtime.py",
            "from pipelines.registry import mlflow_io",
            "plugins and DAGs call entry functions and flows",
        ),
        ("dags/ctr_model_ops.py", "import mlflow", "plugins and DAGs call entry functions and flows"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tree_copy, path, line, contract):
    target = tree_copy / path
    original = target.read_text()
    try:
        target.write_text(original + f"\n{line}  # injected by the test\n")
        out = _lint(tree_copy)
    finally:
        target.write_text(original)
    assert out.returncode != 0, out.stdout
    broken = out.stdout.split("Broken contracts")[-1]
    assert contract in " ".join(broken.split()), out.stdout
    assert path.replace("/", ".").removesuffix(".py").removeprefix("plugins.") in broken, out.stdout
