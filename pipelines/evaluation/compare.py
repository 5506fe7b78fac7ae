"""Stage: score the candidate and the serving @champion on the same holdout rows.

The holdout is re-read from the lake with the training task's definition (`training.adapter.
holdout_streams`), chunk by chunk; its lineage hash must equal the one training saw, so both models
are judged on exactly the rows the candidate held out. Only labels, the two models' pCTRs and the
slice columns are kept, not the features.
"""
from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.errors import PipelineError

log = logging.getLogger(__name__)

SLICE_COLUMNS = ["user_id", "slot", "gender", "age_bucket", "label"]


def score_holdout(cfg: PipelineConfig, lake_uri: str, candidate: dict, models: dict) -> tuple[pd.DataFrame, dict]:
    """(slice columns of every holdout row, {name: pCTR array}) for pyfunc `models` {name: model}."""
    from pipelines.training.adapter import holdout_streams

    streams = holdout_streams(cfg, lake_uri, candidate["end_day"], candidate["slot"], cfg.model)
    sha = streams["index"].lineage()["sha256"]
    if sha != candidate["data"]["sha256"]:
        raise PipelineError(f"the data under {lake_uri} changed between training and evaluation of "
                            f"{candidate['model_name']} (lineage {candidate['data']['sha256'][:12]} != "
                            f"{sha[:12]}); re-run training")
    parts, preds = [], {k: [] for k in models}
    for frame in streams["holdout"].frames():
        parts.append(frame[SLICE_COLUMNS])
        for k, m in models.items():
            preds[k].append(np.asarray(m.predict(frame), dtype=np.float64))
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=SLICE_COLUMNS)
    return rows, {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in preds.items()}


def evaluate(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    import mlflow

    from pipelines.evaluation.metrics import summary
    from pipelines.registry import mlflow_io

    models = {"candidate": mlflow.pyfunc.load_model(candidate["model_uri"])}
    champion_mv = mlflow_io.version_by_alias(candidate["model_name"], "champion")
    if champion_mv is not None:
        models["champion"] = mlflow.pyfunc.load_model(f"models:/{candidate['model_name']}/{champion_mv.version}")
    rows, preds = score_holdout(cfg, lake_uri, candidate, models)
    y = rows["label"].to_numpy(dtype=np.float64)
    cand = summary(y, preds["candidate"])
    champ = summary(y, preds["champion"]) if champion_mv is not None else None
    result = {"model_name": candidate["model_name"], "slot": candidate["slot"], "candidate": cand, "champion": champ,
              "champion_version": str(champion_mv.version) if champion_mv else None, "holdout_rows": int(len(rows))}
    c = mlflow_io.client()
    for who, m in (("candidate", cand), ("champion", champ)):
        for k, v in (m or {}).items():
            if isinstance(v, (int, float)) and v is not None:
                c.log_metric(candidate["run_id"], f"eval_{who}_{k}", float(v))
    log.info("%s on %d holdout rows: candidate AUC %.4f logloss %.4f | champion %s", candidate["model_name"],
             len(rows), cand["auc"] or float("nan"), cand["logloss"] or float("nan"),
             f"v{result['champion_version']} AUC {champ['auc']:.4f} logloss {champ['logloss']:.4f}" if champ else "none")
    return result
