"""Stage: score the candidate and the serving @champion on the same holdout rows, and judge them.

The holdout is re-read from the lake with the training task's definition
(`model.stream.holdout_streams`), chunk by chunk; its lineage hash must equal the one training saw, so both models
are judged on exactly the rows the candidate held out. Only labels, the two models' pCTRs and the
slice columns are kept, not the features.

Judged: overall metrics (AUC, logloss, NE, calibration, ECE, gAUC), per slot, cold vs warm users,
fairness on gender / age bucket, DeLong's test of the AUC difference, the candidate pyfunc's latency
and size, and its interference with the other slots' champions (|cos| of the LoRA updates). All of
it goes to the training run (metrics + an HTML report with plots under `evaluation/`), a compact
table goes to the task log, and a small JSON-safe summary is returned for the gate and the card.
The judging after the scoring is `evaluation.judge`, shared with the cold-start evaluation.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.errors import PipelineError
from pipelines.evaluation import report
from pipelines.evaluation.judge import judge
from pipelines.model.stream import holdout_streams
from pipelines.registry import mlflow_io, pyfunc
from pipelines.registry.model_input import predict_pctr

log = logging.getLogger(__name__)

SLICE_COLUMNS = ["user_id", "slot", "gender", "age_bucket", "label"]


def score_holdout(
    cfg: PipelineConfig, lake_uri: str, candidate: dict, models: dict
) -> tuple[pd.DataFrame, dict, np.ndarray, pd.DataFrame]:
    """(slice columns of every holdout row, {name: pCTR array}, cold-user mask, the first 64 holdout
    rows with every column: what latency is measured on) for pyfunc `models`.

    A holdout row is *cold* when its user has fewer than `cold_start.min_impressions` impressions
    among the window's rows before the holdout (the rows this adapter learned from).
    """
    streams = holdout_streams(cfg, lake_uri, candidate["end_day"], candidate["slot"], cfg.model)
    sha = streams.index.lineage()["sha256"]
    if sha != candidate["data"]["sha256"]:
        raise PipelineError(
            f"the data under {lake_uri} changed between training and evaluation of "
            f"{candidate['model_name']} (lineage {candidate['data']['sha256'][:12]} != "
            f"{sha[:12]}); re-run training"
        )
    seen: Counter = Counter()
    for frame in streams.index.frames(0, streams.holdout.lo, 262_144, columns=["user_id"]):
        seen.update(_user_keys(frame["user_id"]).tolist())
    parts, preds, sample = [], {k: [] for k in models}, None
    for frame in streams.holdout.frames():
        sample = frame.head(64) if sample is None else sample
        parts.append(_compact(frame))
        for k, m in models.items():
            preds[k].append(predict_pctr(m, frame))
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=SLICE_COLUMNS)
    k = cfg.cold_start.min_impressions
    cold = np.array([seen.get(u, 0) < max(k, 1) for u in rows["user_id"].tolist()], dtype=bool)
    preds = {name: (np.concatenate(v) if v else np.zeros(0)) for name, v in preds.items()}
    return rows, preds, cold, (sample if sample is not None else pd.DataFrame())


def _user_keys(users: pd.Series) -> np.ndarray:
    """A user id as a uint64 hash: slices and gAUC only need equality, and 8 bytes a row instead of
    a Python string keeps a multi-million-row holdout small."""
    return pd.util.hash_array(users.astype("string").fillna("<null>").to_numpy(dtype=object))


def _compact(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame[SLICE_COLUMNS].copy()
    out["user_id"] = _user_keys(frame["user_id"])
    for c in ("slot", "gender", "age_bucket"):
        out[c] = out[c].astype("string[pyarrow]")
    return out


def evaluate(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    """The candidate against the serving champion on its holdout; for a candidate judged on the next days
    (`lora.judged_on: next_day`, no holdout) a `waiting` evaluation: `evaluation.next_day` scores it later."""
    if candidate.get("judged_on") == "next_day":
        return {
            "model_name": candidate["model_name"],
            "slot": candidate["slot"],
            "waiting": True,
            "candidate": None,
            "champion": None,
            "champion_version": None,
        }
    models = {"candidate": pyfunc.load(candidate["model_uri"])}
    champion_mv = mlflow_io.version_by_alias(candidate["model_name"], "champion")
    if champion_mv is not None:
        models["champion"] = pyfunc.load(f"models:/{candidate['model_name']}/{champion_mv.version}")
    rows, preds, cold, sample = score_holdout(cfg, lake_uri, candidate, models)
    result, comparison = judge(
        cfg,
        candidate,
        rows,
        preds,
        cold,
        sample,
        served=models["candidate"],
        champion_mv=champion_mv,
        title=f"{candidate['model_name']}: candidate vs champion",
    )
    log.info(
        "%s on %d holdout rows (%d cold-user rows):\n%s",
        candidate["model_name"],
        len(rows),
        int(cold.sum()),
        report.format_table(comparison),
    )
    return result
