"""code_version() is never empty and changes with the code, in an image (no .git, no git, an empty
CTR_CODE_VERSION from an empty build arg) as in a checkout. Each case runs a real Python process on a
copy of the `pipelines` package, as docker/Dockerfile ships it (COPY pipelines/)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.registry import mlflow_io

PRINT = (
    "import pipelines, sys; from pipelines.registry.mlflow_io import code_version; "
    "assert pipelines.__file__.startswith(sys.argv[1]), pipelines.__file__; print(code_version())"
)


@pytest.fixture
def shipped(tmp_path) -> Path:
    """A copy of the package alone (what the image holds), outside any git checkout."""
    root = tmp_path / "opt-ctr"
    shutil.copytree(mlflow_io.PACKAGE_DIR, root / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def version_of(root: Path, path: str | None = None, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "CTR_CODE_VERSION" and not k.startswith("GIT_")}
    base.update(PYTHONPATH=str(root), GIT_CEILING_DIRECTORIES=str(root.parent), **env)
    if path is not None:
        base["PATH"] = path
    proc = subprocess.run(
        [sys.executable, "-c", PRINT, str(root)], cwd=root, env=base, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_an_image_gets_a_hash_of_its_pipelines_files(shipped):
    first = version_of(shipped, CTR_CODE_VERSION="")  # ENV from an empty build arg
    assert re.fullmatch(r"src-[0-9a-f]{16}", first)
    assert first == "src-" + mlflow_io.source_hash(shipped / "pipelines")[:16]
    # stable: compiled files (they depend on the interpreter) and git missing from PATH change nothing
    (shipped / "pipelines" / "__pycache__").mkdir(exist_ok=True)
    (shipped / "pipelines" / "__pycache__" / "config.cpython-311.pyc").write_bytes(b"\0compiled")
    (shipped / "pipelines" / "stray.pyc").write_bytes(b"\0compiled")
    assert version_of(shipped, path=str(Path(sys.executable).parent)) == first
    target = shipped / "pipelines" / "config.py"
    target.write_text(target.read_text() + "\n# a change\n")
    changed = version_of(shipped)
    assert changed != first and changed.startswith("src-")
    (shipped / "pipelines" / "notes.txt").write_text("shipped too")
    assert version_of(shipped) not in (first, changed)


def test_an_explicit_version_wins(shipped):
    assert version_of(shipped, CTR_CODE_VERSION="0123abc") == "0123abc"


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on this machine")
def test_a_checkout_gives_its_commit_and_a_hash_when_dirty(shipped):
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
            cwd=shipped,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    git("add", "pipelines")
    git("commit", "-q", "-m", "code")
    sha = git("rev-parse", "HEAD")
    assert version_of(shipped) == sha
    (shipped / "scratch.txt").write_text("untracked, outside the package: not a code change")
    assert version_of(shipped) == sha
    new_module = shipped / "pipelines" / "extra.py"
    new_module.write_text("X = 1\n")  # not added yet, but importable
    dirty = version_of(shipped)
    assert re.fullmatch(re.escape(sha) + r"-dirty-[0-9a-f]{12}", dirty)
    new_module.write_text("X = 2\n")
    assert version_of(shipped) not in (sha, dirty)
