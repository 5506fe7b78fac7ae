"""`python -m pipelines ...` run as a real subprocess with the venv's interpreter."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines.__main__ import build_parser
from pipelines.config import REPO_ROOT
from pipelines.data.lake import Lake
from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io
from tests.conftest import free_port, use_store_copy
from tests.pipelines.promotion.test_aliases import add_version

STAGES = (
    "generate",
    "validate",
    "train-base",
    "train-adapter",
    "cold-start",
    "promote",
    "revert",
    "override",
    "approve",
    "history",
    "status",
    "bench",
)
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def cli_env(extra: dict | None = None) -> dict:
    """This process's environment without the variables that would point a stage at the caller's own
    config or tracking server, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CTR_PIPELINE_CONFIG", "CTR_GATE_POLICY", "MLFLOW_TRACKING_URI")
    }
    return {**env, **(extra or {})}


def cli(*args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "pipelines", *args],
        cwd=REPO_ROOT,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stdout + p.stderr, p.stderr


def click_frame(n: int = 300, seed: int = 0) -> pd.DataFrame:
    """A valid partition for the default config (MovieLens slots)."""
    rng = np.random.default_rng(seed)
    ts = pd.date_range("2024-01-02", periods=n, freq="min", tz="UTC")
    return pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": [f"u{i % 40}" for i in range(n)],
            "item_id": [f"i{i % 60}" for i in range(n)],
            "slot": rng.choice(["morning", "afternoon", "night"], n),
            "label": (rng.random(n) < 0.3).astype("int8"),
            "age_bucket": rng.choice(["18-24", "25-34"], n),
            "gender": rng.choice(["M", "F"], n),
            "occupation": rng.choice(["student", "engineer"], n),
            "category": rng.choice(["Drama", "Comedy"], n),
            "hour": ts.hour.to_numpy().astype("int8"),
            "weekday": ts.dayofweek.to_numpy().astype("int8"),
        }
    )


# ----------------------------------------------------------------------------- help / usage
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_has_help(stage):
    p = cli(stage, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: python -m pipelines {stage}")
    assert "--" in p.stdout


def test_top_level_help_lists_every_stage():
    p = cli("--help")
    assert p.returncode == 0
    for stage in STAGES:
        assert stage in p.stdout


def test_missing_stage_is_a_usage_error():
    p = cli()
    assert p.returncode == 2 and "usage:" in p.stderr


@pytest.mark.parametrize(
    "argv, dest", [(["promote", "--version", "3"], "version"), (["revert", "--to-version", "12"], "to_version")]
)
def test_a_version_argument_is_the_registrys_string(argv, dest):
    args = build_parser().parse_args([argv[0], "--model", "ctr_lora_feed", "--reason", "why", *argv[1:]])
    assert getattr(args, dest) == argv[-1]


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_a_version_that_is_not_a_positive_integer_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["promote", "--model", "ctr_lora_feed", "--reason", "why", "--version", bad])
    assert exit_.value.code == 2 and "positive integer" in capsys.readouterr().err


# ----------------------------------------------------------------------------- validate
def test_validate_a_valid_local_partition(tmp_path):
    where = Lake(str(tmp_path / "lake")).write_partition(click_frame(), "2024-01-02")
    part = str(Path(where).parent)
    assert part.endswith("dt=2024-01-02")
    p = cli("validate", "--data", part)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"VALID {part}: 300 rows")
    assert "FAILED" not in p.stderr
    no_traceback(p)


def test_validate_a_partition_missing_the_label_column(tmp_path):
    part = tmp_path / "lake" / "dt=2024-01-02"
    part.mkdir(parents=True)
    frame = click_frame().drop(columns=["label"])
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), part / "part-00000.parquet")
    p = cli("validate", "--data", str(part))
    assert p.returncode == 1
    failed = [line for line in p.stderr.splitlines() if line.startswith("FAILED ")]
    assert failed, p.stderr
    assert any("label" in line and "missing column" in line for line in failed), failed
    assert "VALID" not in p.stdout
    no_traceback(p)


def test_validate_a_non_parquet_file(tmp_path):
    part = tmp_path / "lake" / "dt=2024-01-02"
    part.mkdir(parents=True)
    (part / "part-00000.parquet").write_bytes(b"this is not parquet at all\n")
    p = cli("validate", "--data", str(part))
    assert p.returncode == 1
    failed = [line for line in p.stderr.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and "readable_partition" in failed[0], p.stderr
    assert "part-00000.parquet" in failed[0] and "not readable parquet" in failed[0]
    no_traceback(p)


def test_validate_a_missing_partition(tmp_path):
    p = cli("validate", "--data", str(tmp_path / "nope" / "dt=2024-01-02"))
    assert p.returncode == 1
    assert "no .parquet files" in p.stderr and p.stderr.startswith("FAILED ")
    no_traceback(p)


def test_validate_with_a_bad_config_is_a_config_error(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"validation": {"min_row": 5}}))
    p = cli("validate", "--data", str(tmp_path), "--config", str(cfg))
    assert p.returncode == 2
    assert p.stderr.startswith("config error:") and "min_row" in p.stderr
    no_traceback(p)


# ----------------------------------------------------------------------------- generate
def test_generate_synthetic_writes_dt_partitions(tmp_path):
    out = tmp_path / "lake"
    p = cli("generate", "--source", "synthetic", "--out", str(out), "--days", "2", "--rows-per-day", "1000")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary == {
        "out": str(out),
        "source": "synthetic",
        "partitions": 2,
        "first": "2026-01-01",
        "last": "2026-01-02",
    }
    assert sorted(d.name for d in out.iterdir()) == ["dt=2026-01-01", "dt=2026-01-02"]
    lake = Lake(str(out))
    assert lake.list_partitions() == ["2026-01-01", "2026-01-02"]
    for day in lake.list_partitions():
        part = lake.read_partition(day)
        assert len(part.frame) == 1000
        assert (part.frame["event_ts"].dt.strftime("%Y-%m-%d") == day).all()
    no_traceback(p)


def test_generated_synthetic_data_passes_validation_with_the_synthetic_config(tmp_path):
    out = tmp_path / "lake"
    assert (
        cli("generate", "--source", "synthetic", "--out", str(out), "--days", "1", "--rows-per-day", "2000").returncode
        == 0
    )
    p = cli("validate", "--data", str(out / "dt=2026-01-01"), "--config", str(REPO_ROOT / "configs" / "synthetic.yaml"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("VALID ")
    # The MovieLens config's slots (time-of-day proxies) do not admit ad placements.
    p = cli("validate", "--data", str(out / "dt=2026-01-01"))
    assert p.returncode == 1 and "expect_column_values_to_be_in_set(slot)" in p.stderr


# ----------------------------------------------------------------------------- unexpected errors
def unreachable_tracking() -> dict:
    """A tracking server URI at a port nothing listens on, without retries: the first registry call of
    a stage fails at once with MLflow's own exception (not one of pipelines.errors)."""
    return {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def test_an_unexpected_error_is_one_line_naming_the_stage_and_the_exception():
    p = cli("status", env=unreachable_tracking())
    assert p.returncode == 3, p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error in status: MlflowException: API request to http://127.0.0.1:"), p.stderr
    assert "Connection refused" in p.stderr and p.stdout == ""
    no_traceback(p)


@pytest.mark.parametrize("argv", [("--verbose", "status"), ("status", "-v")], ids=["before-stage", "after-stage"])
def test_verbose_adds_the_full_traceback_before_the_one_line(argv):
    p = cli(*argv, env=unreachable_tracking())
    assert p.returncode == 3, p.stderr
    assert "Traceback (most recent call last):" in p.stderr and "ConnectionRefusedError" in p.stderr
    assert p.stderr.splitlines()[-1].startswith("error in status: MlflowException: "), p.stderr


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as a shell gives it (default action, not blocked). A child inherits
    an ignored or blocked SIGINT from its parent, and Python then never raises KeyboardInterrupt: in CI
    the test hung twice that way, under an xdist worker, with the request already sent."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_stage_exits_130_with_one_line():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(60)
        env = cli_env(
            {
                "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{server.getsockname()[1]}",
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
            }
        )
        proc = subprocess.Popen(
            [PYTHON, "-m", "pipelines", "status"],
            cwd=REPO_ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_terminal_sigint,
        )
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            assert conn.recv(65536).startswith(b"GET ")  # the request is sent: the stage now waits on a server
            proc.send_signal(signal.SIGINT)  # that never answers; Ctrl-C it there
            out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["interrupted in status"] and out == ""


# ----------------------------------------------------------------------------- promote / approve / override
@pytest.fixture
def registry(template_db, tmp_path, monkeypatch):
    """A SQLite store with a serving base and ctr_lora_feed v1..v3 on it (passed, first runs); v2 was
    rejected by a person. Yields the store's URI for the CLI subprocesses."""
    uri = use_store_copy(template_db, tmp_path, monkeypatch)
    base = add_version("ctr_base", gate_passed=None, fingerprint="f" * 64)
    mlflow_io.client().set_registered_model_alias("ctr_base", "champion", base)
    for _ in range(3):
        add_version("ctr_lora_feed", base__fingerprint="f" * 64, gate__champion_version="")
    release.record_approval("ctr_lora_feed", "2", answer="Reject", by="bob", at="2024-01-05", task="test")
    yield uri
    mlflow.set_tracking_uri(None)


def test_cli_promote_refuses_a_rejected_version_and_override_records_the_rejection(registry):
    env = {"MLFLOW_TRACKING_URI": registry}
    p = cli("promote", "--model", "ctr_lora_feed", "--version", "2", "--reason", "bob was wrong", env=env)
    assert p.returncode == 1 and "v2 was rejected by bob" in p.stderr, p.stderr
    assert aliases.current("ctr_lora_feed") is None
    p = cli(
        "override",
        "--model",
        "ctr_lora_feed",
        "--version",
        "2",
        "--reason",
        "fixed upstream",
        "--actor",
        "carol",
        env=env,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["kind"] == "override" and out["overrides_rejection"]["by"] == "bob" and out["actor"] == "carol"
    assert aliases.current("ctr_lora_feed") == "2"
    no_traceback(p)


def test_cli_promote_follows_the_policys_approval_and_approve_releases(registry, tmp_path):
    policy = tmp_path / "gate.yaml"
    policy.write_text("approval: true\npromotion: direct\n")
    env = {"MLFLOW_TRACKING_URI": registry}
    p = cli(
        "promote", "--model", "ctr_lora_feed", "--version", "1", "--reason", "by hand", "--policy", str(policy), env=env
    )
    assert p.returncode == 1 and "v1 needs a recorded approval" in p.stderr, p.stderr
    assert aliases.current("ctr_lora_feed") is None
    p = cli(
        "approve",
        "--model",
        "ctr_lora_feed",
        "--version",
        "1",
        "--answer",
        "Approve",
        "--actor",
        "alice",
        "--policy",
        str(policy),
        env=env,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["approval"]["by"] == "alice" and out["release"]["moved"] and aliases.current("ctr_lora_feed") == "1"
    assert aliases.history("ctr_lora_feed")[-1]["reason"] == "passed gate (first run) (approved by alice)"


def test_cli_reason_over_the_limit_is_refused(registry):
    p = cli(
        "promote",
        "--model",
        "ctr_lora_feed",
        "--version",
        "1",
        "--reason",
        "x" * 2000,
        env={"MLFLOW_TRACKING_URI": registry},
    )
    assert p.returncode == 1 and "a reason is at most 1000 characters (got 2000)" in p.stderr, p.stderr
