"""Stage: a waiting candidate and the serving champion, scored on one validated day after its window.

A candidate trained with `lora.judged_on: next_day` holds nothing out: every row of its window trained it. Each
validated day after that window (the real future: rows neither model trained on), this scores it and its slot's
serving @champion on that day's rows of its slot (every slot's with `lora.train_rows: all`, the rows it trains
on, as its holdout would be) and returns what the gate reads: the same summary as
`compare.evaluate` (so the AUC floor, calibration, fairness, latency and interference act at once), plus the
day's paired evidence: the count, sum and sum of squares of logloss(champion) - logloss(candidate) per row,
which `promotion.sequential` adds up over the days the candidate waits. The report goes to the candidate's
training run under `judge/<day>/`, the metrics as `shadow_*` at the day's step (days since 1970-01-01), and
the day's figures of the judged version and of the one beside it to the slot's timeline run
(`evaluation.timeline`: AUC over days per slot, one line each in MLflow's charts).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.evaluation import timeline
from pipelines.evaluation.compare import SLICE_COLUMNS, _compact, _user_keys
from pipelines.evaluation.judge import judge
from pipelines.evaluation.timeline import day_step
from pipelines.metrics import paired_differences
from pipelines.model.stream import LakeIndex
from pipelines.registry import mlflow_io, pyfunc
from pipelines.registry.model_input import predict_pctr

log = logging.getLogger(__name__)


def evaluate_day(
    cfg: PipelineConfig,
    lake_uri: str,
    model: str,
    version: str,
    day: str,
    against: str | None = None,
    alone: bool = False,
) -> dict | None:
    """The evaluation of waiting `model` v`version` on validated `day`'s rows of its slot beside `@champion` (or
    beside v`against`; `alone`: beside nothing, as a first version), with `judged_day` and `evidence` ({"n",
    "total", "total_sq"}; None with nothing to compare with); None when the day has no row of it."""
    mv = mlflow_io.get_version(model, version)
    slot = mv.tags["slot"]
    # the rows it trains on, as the holdout does: its slot's, or every slot's with lora.train_rows: all
    day_rows = LakeIndex(lake_uri, day, days=1, slot=slot if cfg.lora.train_rows == "slot" else None)
    if day_rows.rows == 0:
        return None
    champion_mv = (
        None
        if alone
        else mlflow_io.get_version(model, against)
        if against
        else mlflow_io.version_by_alias(model, "champion")
    )
    models = {"candidate": pyfunc.load(f"models:/{model}/{version}")}
    if champion_mv is not None:
        models["champion"] = pyfunc.load(f"models:/{model}/{champion_mv.version}")
    rows, preds, sample = _score(day_rows, models)
    cold = _cold(cfg, lake_uri, mv.tags["judge.trained_through"], slot, rows)
    candidate = {
        "model_name": model,
        "slot": slot,
        "run_id": mv.run_id,
        "model_uri": f"models:/{model}/{version}",
        "base": {"fingerprint": mv.tags.get("base.fingerprint")},
    }
    result, _ = judge(
        cfg,
        candidate,
        rows,
        preds,
        cold,
        sample,
        served=models["candidate"],
        champion_mv=champion_mv,
        title=f"{model} v{version} beside its champion on {day}",
        artifact_dir=f"judge/{day}",
        metric_prefix="shadow",
        step=day_step(day),
    )
    evidence = None
    if "champion" in preds:
        d = paired_differences(rows["label"].to_numpy(dtype=np.float64), preds["champion"], preds["candidate"])
        evidence = {"n": int(len(d)), "total": float(d.sum()), "total_sq": float((d * d).sum())}
    # beside a champion it replaced (`against`), that one serves no more: only the judged version is on the line
    beside = [(str(champion_mv.version), result["champion"])] if champion_mv is not None and not against else []
    timeline.record(model, slot, day, [(str(version), result["candidate"]), *beside])
    theirs = (result["champion"] or {}).get("auc")
    log.info(
        "%s v%s judged on %s: %d rows, AUC %s beside %s",
        model,
        version,
        day,
        len(rows),
        _fmt(result["candidate"].get("auc")),
        f"v{champion_mv.version}'s {_fmt(theirs)}" if champion_mv is not None else "no champion",
    )
    return {**result, "judged_day": day, "evidence": evidence}


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _score(index, models: dict) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """(slice columns, {name: pCTRs}, the first 64 rows with every column) of the index's rows."""
    parts, preds, sample = [], {k: [] for k in models}, None
    for frame in index.frames(0, index.rows, 262_144):
        sample = frame.head(64) if sample is None else sample
        parts.append(_compact(frame))
        for k, m in models.items():
            preds[k].append(predict_pctr(m, frame))
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=SLICE_COLUMNS)
    return rows, {k: np.concatenate(v) for k, v in preds.items()}, sample


def _cold(cfg: PipelineConfig, lake_uri: str, trained_through: str, slot: str, rows: pd.DataFrame) -> np.ndarray:
    """Rows whose user had fewer than `cold_start.min_impressions` impressions in the candidate's window."""
    window = LakeIndex(
        lake_uri, trained_through, days=cfg.lora.window_days, slot=slot if cfg.lora.train_rows == "slot" else None
    )
    seen: Counter = Counter()
    for frame in window.frames(0, window.rows, 262_144, columns=["user_id"]):
        seen.update(_user_keys(frame["user_id"]).tolist())
    k = max(cfg.cold_start.min_impressions, 1)
    return np.array([seen.get(u, 0) < k for u in rows["user_id"].tolist()], dtype=bool)
