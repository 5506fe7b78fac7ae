"""`backtest --scores` and `backtest-compare`: every scored row kept, two runs paired by DeLong on the same rows."""

import json
import subprocess
import sys

import mlflow
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines.bench import backtest, backtest_scores
from pipelines.config import load_pipeline_config
from pipelines.data import movielens
from pipelines.errors import ConfigError
from pipelines.evaluation.delong import delong_test
from pipelines.metrics import auc


@pytest.mark.parametrize(
    "ci95, verdict",
    [
        ([0.01, 0.05], "met"),
        ([0.012, 0.03], "met"),
        ([-0.02, 0.0099], "missed"),
        ([-0.04, 0.04], "undecided"),
        ([0.0, 0.01], "undecided"),
    ],
)
def test_the_verdict_needs_the_whole_interval_on_one_side_of_the_margin(ci95, verdict):
    assert backtest_scores.verdict(ci95, 0.01) == verdict


def test_the_rows_for_a_decision_grow_with_the_square_of_the_interval():
    # se 0.04 on 202 rows: a +-0.01 interval needs (1.96 * 0.04 / 0.01)^2 = 61.46 times the rows
    assert backtest_scores.rows_for_halfwidth(202, 0.04, 0.01) == 12_416
    assert backtest_scores.rows_for_halfwidth(202, 0.0, 0.01) is None  # no variance: nothing to narrow


@pytest.fixture(scope="module")
def two_days(tmp_path_factory):
    """A real two-day replay (the default family's base, the daily LR), its scores written."""
    path = tmp_path_factory.mktemp("scores") / "default.parquet"
    cfg = load_pipeline_config(overrides={"base_training": {"epochs": 1}})
    r = backtest.run(cfg, movielens.load(), max_days=2, names=("static", "lr_daily"), parallel=False, scores=str(path))
    return r, path


@pytest.mark.slow
def test_the_scores_file_holds_every_scored_row_and_the_auc_the_backtest_reported(two_days):
    r, path = two_days
    rows, meta = backtest_scores.read(str(path))
    assert r["scores"] == str(path) and meta == {
        "protocol": "replay",
        "model_family": "feature_transformer",
        "from": r["from"],
        "to": r["to"],
    }
    assert len(rows) == r["rows"] and int(rows["warm"].sum()) == r["warm_rows"]
    assert int(rows["new_item"].sum()) == r["new_item_rows"]
    assert sorted(rows["date"].unique()) == [d["date"] for d in r["per_day"]]
    for name in ("static", "lr_daily"):
        y, p = rows["label"].to_numpy(), rows[f"score_{name}"].to_numpy()
        assert round(auc(y, p), 4) == r[f"{name}_auc"]
        warm = rows["warm"].to_numpy()
        assert round(auc(y[warm], p[warm]), 4) == r[f"{name}_auc_warm"]


@pytest.mark.slow
def test_the_cli_pairs_two_comparators_on_the_same_rows_by_delong(two_days):
    _, path = two_days
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest-compare",
            f"{path}:lr_daily",
            str(path),
            "--margin",
            "0.01",
            "--plot",
            str(path.parent / "forest.png"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    r = json.loads(out.stdout)
    assert (path.parent / "forest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r["plot"].endswith("forest.png")
    assert (r["a"]["comparator"], r["b"]["comparator"]) == ("lr_daily", "static")
    rows, _ = backtest_scores.read(str(path))
    y = rows["label"].to_numpy()
    want = delong_test(y, rows["score_lr_daily"].to_numpy(), rows["score_static"].to_numpy())
    every = r["parts"]["all"]
    assert every["rows"] == len(rows) and every["diff"] == round(want["diff"], 4)
    assert every["ci95"] == [round(v, 4) for v in want["ci95"]] and every["verdict"] == backtest_scores.verdict(
        want["ci95"], 0.01
    )
    cold = ~rows["warm"].to_numpy()
    assert r["parts"]["cold"]["rows"] == int(cold.sum())
    assert r["parts"]["cold"]["auc_b"] == round(auc(y[cold], rows["score_static"].to_numpy()[cold]), 4)
    # against itself: no difference, no variance, so a goal of +0.01 is missed
    same = backtest_scores.compare(str(path), str(path), margin=0.01)["parts"]["all"]
    assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["verdict"] == "missed"


@pytest.mark.slow
def test_files_of_other_rows_or_without_the_comparator_are_refused(two_days, tmp_path):
    _, path = two_days
    rows = pd.read_parquet(path)
    shorter = tmp_path / "shorter.parquet"

    table = pq.read_table(path)
    pq.write_table(table.slice(0, len(rows) - 1), shorter)  # the metadata travels with the slice
    with pytest.raises(ConfigError, match="did not score the same rows"):
        backtest_scores.compare(str(path), str(shorter))
    with pytest.raises(ConfigError, match=r"has no scores of 'adapter'; it has \['static', 'lr_daily'\]"):
        backtest_scores.compare(str(path), f"{path}", comparator_a="adapter")
    plain = tmp_path / "plain.parquet"
    rows.to_parquet(plain)
    bad = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest-compare", str(plain), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "is not a `backtest --scores` file" in bad.stderr


def test_a_part_with_one_class_says_why_it_has_no_difference():
    y = np.zeros(5, dtype=np.int64)
    out = backtest_scores.part(y, np.arange(5.0), np.arange(5.0), 0.01)
    assert out["rows"] == 5 and "needs at least 2 positive" in out["error"] and "diff" not in out


@pytest.mark.slow
def test_a_comparison_logged_to_an_mlflow_server_carries_its_figures_verdicts_and_picture(two_days, on_mlflow_server):
    _, path = two_days
    r = backtest_scores.compare(f"{path}", f"{path}", "lr_daily", "static", margin=0.01)
    run = mlflow.MlflowClient().get_run(backtest_scores.log_to_mlflow(r))
    every = r["parts"]["all"]
    assert run.data.metrics["diff_all"] == every["diff"] and run.data.metrics["ci95_low_all"] == every["ci95"][0]
    assert {k: v for k, v in run.data.tags.items() if k.startswith("verdict.")} == {
        f"verdict.{n}": p["verdict"] for n, p in r["parts"].items() if "verdict" in p
    }
    assert run.data.tags["verdict.all"] == every["verdict"]
    assert run.data.tags["stage"] == "backtest-compare" and run.data.tags["a.comparator"] == "lr_daily"
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "compare")}
    assert arts == {"compare/compare.png", "compare/compare.json"}
