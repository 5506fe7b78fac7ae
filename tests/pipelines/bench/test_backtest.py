"""The backtest on MovieLens-100K, two days, every comparator (real models, real PEFT, the second process)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest

from pipelines.bench import backtest, backtest_lr, backtest_protocol, backtest_report
from pipelines.config import load_pipeline_config
from pipelines.data import movielens
from pipelines.metrics import auc
from tests.pipelines.model.user_family import HashedMLP

pytestmark = pytest.mark.slow

FIVE = tuple(n for n in backtest.COMPARATORS if n != "served")  # served: tests/pipelines/bench/test_backtest_served.py


@pytest.fixture(scope="module")
def frame():
    return movielens.load()


def test_two_days_of_every_comparator_and_the_report_on_an_mlflow_server(frame, on_mlflow_server, tmp_path):
    cfg = load_pipeline_config(overrides={"base_training": {"epochs": 1}, "lora": {"epochs": 1}})
    r = backtest.run(cfg, frame, max_days=2, names=FIVE)

    assert r["from"] == "1998-03-07" and r["days"] == 2
    assert r["rows"] == sum(d["rows"] for d in r["per_day"]) == r["warm_rows"] + r["cold_rows"]
    for name in FIVE:
        for suffix in ("", "_warm", "_cold"):
            assert 0.55 < r[f"{name}_auc{suffix}"] < 0.9, (name, suffix, r[f"{name}_auc{suffix}"])
    # full_retrain's first day is the static base: same rows, same seed, trained in another process (its
    # days are split over two: each process's scores land on its own days, and their CPU seconds add up)
    assert backtest.SHARDS["full_retrain"] == 2 and not np.isnan(r["per_day"][1]["full_retrain"])
    assert r["per_day"][0]["full_retrain"] == r["per_day"][0]["static"]
    assert r["per_day"][1]["full_retrain"] != r["per_day"][1]["static"]
    # adapters: the shipped kind (a delta on every slot's rows: one a day), LoRA and id rows per slot
    shipped, ids, plain = (r["comparators"][n] for n in ("adapter", "adapter_ids", "adapter_lora"))
    assert r["adapter_kind"] == "delta" and shipped["lora"]["kind"] == "delta" and shipped["per_slot"] is False
    assert shipped["adapters_trained"] == 2 and plain["adapters_trained"] == ids["adapters_trained"] == 6
    assert shipped["token_rows_mean"] > 20 and shipped["lora"]["trainable_tokens"] == ["user_id", "item_id"]
    assert ids["token_rows_mean"] > 20 and plain["token_rows_mean"] is None
    assert r["adapter_ids_bytes"] > r["adapter_lora_bytes"] > 0 and r["adapter_bytes"] > 0
    assert ids["lora"]["trainable_tokens"] == ["user_id"] and ids["lora"]["tokens_only"]
    assert plain["lora"]["trainable_tokens"] == [] and plain["lora"]["kind"] == "lora"
    assert plain["lora"]["window_days"] == 28 and plain["lora"]["lr"] == 0.005  # the LoRA recipe, as before
    assert all(
        r[f"{n}_cpu_s"] > 0 for n in ("static", "adapter", "adapter_ids", "full_retrain", "lr_daily", "lr_delta")
    )
    # the LR fitted at the cut is the daily LR of the first day; the delta moves it from the first day on
    assert r["per_day"][0]["lr_static"] == r["per_day"][0]["lr_daily"] != r["per_day"][0]["lr_delta"]
    assert 0 < r["adapter_ids_cost_share"] < 1 and 0 < r["adapter_cost_share"] < 1
    assert set(r["comparators"]["lr_daily"]["val_auc_by_C"]) == {str(c) for c in backtest_lr.LR_C_GRID}
    assert r["per_day"][-1]["cum_lr_daily"] == r["lr_daily_auc"]  # cumulative up to the last day = overall

    files = backtest_report.write(r, tmp_path / "report")
    page = Path(files["html"]).read_text()
    assert "1998-03-08" in page and 'src="auc_over_time.png"' in page and "| adapter_ids |" in page
    assert Path(files["image"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(Path(files["json"]).read_text())["rows"] == r["rows"]
    run_id = backtest_report.log_to_mlflow(r, files)
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.data.metrics["adapter_ids_auc"] == r["adapter_ids_auc"] and run.data.tags["stage"] == "backtest"
    curve = client.get_metric_history(run_id, "cum_full_retrain_auc")
    assert [(m.step, m.value) for m in curve] == [(i + 1, d["cum_full_retrain"]) for i, d in enumerate(r["per_day"])]
    assert {a.path for a in client.list_artifacts(run_id, "backtest")} == {
        "backtest/backtest.html",
        "backtest/auc_over_time.png",
        "backtest/backtest.json",
    }


def test_the_cli_scores_the_static_benchmarks_test_rows_by_the_lr_refitted_on_what_came_before(frame):
    out = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest", "--days", "1", "--only", "lr_daily", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    r = json.loads(out.stdout)
    assert "backtest day 1/1 1998-03-07" in out.stderr  # progress, a line per day

    # by hand: the first day's rows of the static benchmark's test part, the LR fitted on its train part
    train, test = backtest_protocol.temporal_split(frame, backtest_protocol.TRAIN_FRACTION)
    day = test[test["event_ts"].dt.strftime("%Y-%m-%d") == "1998-03-07"]
    assert r["rows"] == len(day) and r["days"] == 1
    C = r["comparators"]["lr_daily"]["C"]
    y, p = day["label"].to_numpy(), backtest_lr.predict_lr(backtest_lr.fit_lr(train, C), day)
    assert r["lr_daily_auc"] == round(auc(y, p), 4)
    warm = day["user_id"].isin(set(train["user_id"])).to_numpy()
    assert r["warm_rows"] == int(warm.sum())
    assert r["lr_daily_auc_warm"] == round(auc(y[warm], p[warm]), 4)
    assert np.isfinite(r["lr_daily_cpu_s"])


def test_an_unknown_comparator_or_day_is_a_usage_error():
    bad = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest", "--from", "1990-01-01"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no rows before 1990-01-01" in bad.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest", "--only", "static,xgboost"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "unknown comparators ['xgboost']" in unknown.stderr


def test_ids_on_every_slot_train_one_adapter_a_day(frame):
    cfg = load_pipeline_config(overrides={"base_training": {"epochs": 1}, "lora": {"epochs": 1}})
    r = backtest.run(cfg, frame, max_days=2, names=("adapter_ids",), ids_per_slot=False)
    ids = r["comparators"]["adapter_ids"]
    assert ids["adapters_trained"] == 2 and ids["per_slot"] is False
    assert set(r) >= {"adapter_ids_auc", "adapter_ids_auc_warm", "adapter_ids_auc_cold"} and "static_auc" not in r


@pytest.mark.parametrize(
    "config", ["configs/pipeline.yaml", "configs/movielens_dcn.yaml", "configs/movielens_text.yaml"]
)
def test_the_backtest_runs_on_each_shipped_family_config(config, frame, text_source):
    """The same replay on every family (the text one on the tiny in-test transformer): a static base of the
    family and its daily adapters score the day, with the new-item AUC and the adapter's CPU seconds."""
    over = {"base_training": {"epochs": 1}, "lora": {"epochs": 1}}
    cfg = load_pipeline_config(
        config, overrides={**over, "model": {"text": {"source": text_source}}} if "text" in config else over
    )
    r = backtest.run(cfg, frame, max_days=2, names=("static", "adapter"), quick=True)
    assert r["model_family"] == cfg.model.family and r["days"] == 2
    assert 0.0 < r["static_auc"] < 1.0 and 0.0 < r["adapter_auc"] < 1.0
    assert "static_auc_new_item" in r and isinstance(r["new_item_rows"], int)  # the rule: test_backtest_protocol
    info = r["comparators"]["adapter"]
    assert info["adapters_trained"] == 2 and info["cpu_s_per_adapter"] > 0
    assert info["lora"]["target_modules"] == list(cfg.lora.target_modules)


def test_the_backtest_replays_a_users_own_network_named_in_the_config(frame):
    """A family of the user's (`model.family: package.module:Factory`, nothing of ours underneath) replays
    as the shipped ones do: its base, its daily adapters on its own LoRA targets, the new-item AUC."""
    targets = list(HashedMLP.default_targets)
    # a delta needs the default family's wide term: this network has none, so its adapters are LoRA
    cfg = load_pipeline_config(
        overrides={
            "model": {"family": HashedMLP.name},
            "base_training": {"epochs": 1, "wide_l2": 0.0, "wide_l2_grid": []},
            "lora": {"epochs": 1, "target_modules": targets, "kind": "lora", "trainable_tokens": []},
            "cold_start": {"target_modules": targets, "init": "default"},
        }
    )
    r = backtest.run(cfg, frame, max_days=2, names=("static", "adapter"), quick=True)
    assert r["model_family"] == HashedMLP.name and 0.5 < r["static_auc"] < 1.0 and 0.0 < r["adapter_auc"] < 1.0
    info = r["comparators"]["adapter"]
    assert info["adapters_trained"] == 2 and info["lora"]["target_modules"] == targets and r["adapter_bytes"] > 0


@pytest.mark.parametrize(
    "config", ["configs/pipeline.yaml", "configs/movielens_dcn.yaml", "configs/movielens_text.yaml"]
)
def test_a_cached_static_base_is_loaded_and_scores_as_the_fitted_one(config, frame, text_source, tmp_path):
    """`--base-cache`: the second replay loads the base the first one fitted (no training CPU, the same
    scores); another base setting is another key, so it is fitted, never served from the cache."""
    over = {"base_training": {"epochs": 1}, "lora": {"epochs": 1}}
    cfg = load_pipeline_config(
        config, overrides={**over, "model": {"text": {"source": text_source}}} if "text" in config else over
    )
    cache = str(tmp_path / "bases")
    first = backtest.run(cfg, frame, max_days=1, names=("static",), quick=True, base_cache=cache)
    saved = list(Path(cache).glob(f"{cfg.model.family}-*.pt"))
    assert len(saved) == 1 and first["static_cpu_s"] > 0 and "static" not in first["comparators"]
    again = backtest.run(cfg, frame, max_days=1, names=("static", "adapter"), quick=True, base_cache=cache)
    assert again["comparators"]["static"]["base_loaded_from"] == str(saved[0])
    assert again["static_cpu_s"] == 0.0 and again["static_auc"] == first["static_auc"]
    assert again["comparators"]["adapter"]["adapters_trained"] == 1
    other = dataclasses.replace(cfg, base_training=dataclasses.replace(cfg.base_training, lr=cfg.base_training.lr / 2))
    moved = backtest.run(other, frame, max_days=1, names=("static",), quick=True, base_cache=cache)
    assert moved["static_cpu_s"] > 0 and len(list(Path(cache).glob("*.pt"))) == 2
