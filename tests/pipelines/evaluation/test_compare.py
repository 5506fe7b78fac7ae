"""The evaluation stage on a real store and lake: the full judgement of a candidate against the serving
champion (slices, cold/warm, fairness, DeLong, latency, size, interference), logged to the training
run with an HTML report and plots, and refused when the data changed since training."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from pipelines.config import LoraTrainConfig
from pipelines.errors import PipelineError
from pipelines.evaluation.compare import evaluate, score_holdout
from pipelines.evaluation.delong import delong_test
from pipelines.promotion import aliases
from pipelines.registry import pyfunc
from pipelines.registry.register import register
from pipelines.training import adapter

END_DAY = "2024-01-05"


def champion_of(cfg, lake, slot: str, **lora) -> dict:
    c = cfg if not lora else cfg.__class__(**{**cfg.__dict__, "lora": LoraTrainConfig(**{**cfg.lora.__dict__, **lora})})
    cand = adapter.train(c, lake, END_DAY, slot).to_dict()
    reg = register(c, cand, evaluate(c, lake, cand))
    aliases.move_alias(reg["model"], "champion", reg["version"], kind="promote", reason="test", actor="test")
    return cand


def assert_clean_log(records: list[logging.LogRecord]) -> None:
    """No MLflow complaint about columns outside the signature, nothing at ERROR, and no line that
    repeats (a repeat is a per-batch message: it would bury the log of a real holdout).

    caplog sees MLflow's records although its `mlflow` logger does not propagate: pytest attaches its
    handler to every non-propagating logger that exists when the test starts (mlflow is imported above).
    Under Airflow that logger's own stderr handler is what makes each of its records an ERROR line."""
    lines = [(r.levelname, r.name, r.getMessage()) for r in records]
    assert not [x for x in lines if "Found extra inputs" in x[2]], lines
    assert not [x for x in lines if x[0] in ("ERROR", "CRITICAL")], lines
    assert not [x for x, n in Counter(lines).items() if n > 1], lines


def test_first_candidate_is_judged_on_every_slice_and_logged_with_a_report(cfg, lake):
    champion_of(cfg, lake, "search")  # serves next to feed: the interference partner
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    ev = evaluate(cfg, lake, cand)
    json.dumps(ev)
    assert ev["champion"] is None and ev["delong"] is None and ev["holdout_rows"] > 100
    for k in ("auc", "logloss", "ne", "calibration_ratio", "ece", "gauc"):
        assert ev["candidate"][k] is not None, k
    assert 0 < ev["candidate"]["ne"] < 2 and ev["candidate"]["auc"] == pytest.approx(cand["metrics"]["auc"])
    rep = ev["report"]
    assert list(rep["slots"]) == ["feed"] and rep["slots"]["feed"]["rows"] == ev["holdout_rows"]
    assert set(rep["cold_warm"]) <= {"cold", "warm"} and rep["cold_warm"]
    assert set(rep["fairness"]) == {"gender", "age_bucket"}
    assert {"batch_1", "batch_32"} == set(ev["latency"]) and ev["latency"]["batch_32"]["p50_ms"] > 0
    assert 0 < ev["adapter_bytes"] < 1_000_000
    inter = ev["interference"]
    assert inter["pair"] == ["candidate", "ctr_lora_search:1"] and 0.0 <= inter["max_abs_cos"] <= 1.0
    assert inter["compared"] == 1 and inter["bounded"] is True  # one sibling champion; a slot adapter

    run = MlflowClient().get_run(cand["run_id"])
    m = run.data.metrics
    assert m["eval_candidate_ne"] == pytest.approx(ev["candidate"]["ne"])
    assert m["eval_latency_batch_32_p99_ms"] >= m["eval_latency_batch_32_p50_ms"] > 0
    assert "eval_interference_max_abs_cos" in m and "eval_fairness_gender_equalized_odds_difference" in m
    files = {a.path for a in MlflowClient().list_artifacts(cand["run_id"], "evaluation")}
    assert {
        "evaluation/report.html",
        "evaluation/roc.png",
        "evaluation/reliability.png",
        "evaluation/comparison.json",
    } <= files
    html = Path(mlflow.artifacts.download_artifacts(run_id=cand["run_id"], artifact_path="evaluation/report.html"))
    assert "roc.png" in html.read_text()


def test_candidate_vs_champion_on_the_same_rows_with_delong(cfg, lake, caplog):
    champion_of(cfg, lake, "feed")
    cand = adapter.train(
        cfg.__class__(**{**cfg.__dict__, "lora": LoraTrainConfig(**{**cfg.lora.__dict__, "seed": 11})}),
        lake,
        END_DAY,
        "feed",
    ).to_dict()
    caplog.set_level(logging.WARNING)
    caplog.clear()
    ev = evaluate(cfg, lake, cand)  # candidate and champion scored, latency measured
    assert_clean_log(caplog.records)
    assert ev["champion_version"] == "1" and ev["champion"]["rows"] == ev["candidate"]["rows"]
    d = ev["delong"]
    assert d["diff"] == pytest.approx(ev["candidate"]["auc"] - ev["champion"]["auc"])
    assert d["ci95"][0] <= d["diff"] <= d["ci95"][1] and 0.0 <= d["p_value"] <= 1.0

    models = {"cand": pyfunc.load(cand["model_uri"]), "champ": pyfunc.load("models:/ctr_lora_feed/1")}
    rows, preds, cold, sample = score_holdout(cfg, lake, cand, models)
    again = delong_test(rows["label"].to_numpy(dtype=float), preds["cand"], preds["champ"])
    assert again["p_value"] == pytest.approx(d["p_value"]) and len(sample) == 64
    assert cold.dtype == bool and len(cold) == len(rows)


def test_evaluation_refuses_data_that_changed_since_training(cfg, lake, tmp_path):
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    changed = {**cand, "data": {**cand["data"], "sha256": "0" * 64}}
    with pytest.raises(PipelineError, match="changed between training and evaluation"):
        evaluate(cfg, lake, changed)
    assert np.isfinite(cand["metrics"]["auc"])
