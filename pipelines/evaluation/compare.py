"""Stage: score the candidate and the serving @champion on the same holdout rows.

The holdout is re-read from the lake with the training task's arguments; its lineage hash must
equal the one training saw, so both models are judged on exactly the rows the candidate held out.
"""
from __future__ import annotations

import logging

from pipelines.config import PipelineConfig
from pipelines.errors import PipelineError

log = logging.getLogger(__name__)


def evaluate(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    import mlflow

    from pipelines.evaluation.metrics import summary
    from pipelines.model.features import labels
    from pipelines.registry import mlflow_io
    from pipelines.training.data import load_split

    lc = cfg.lora
    split = load_split(lake_uri, candidate["end_day"], lc.holdout_fraction, days=lc.window_days,
                       slot=candidate["slot"], min_rows=lc.min_rows)
    if split.lineage["sha256"] != candidate["data"]["sha256"]:
        raise PipelineError(f"the data under {lake_uri} changed between training and evaluation of "
                            f"{candidate['model_name']} (lineage {candidate['data']['sha256'][:12]} != "
                            f"{split.lineage['sha256'][:12]}); re-run training")
    rows, y = split.holdout, labels(split.holdout)
    cand = summary(y, mlflow.pyfunc.load_model(candidate["model_uri"]).predict(rows))
    champion_mv = mlflow_io.version_by_alias(candidate["model_name"], "champion")
    champ = None
    if champion_mv is not None:
        champ_model = mlflow.pyfunc.load_model(f"models:/{candidate['model_name']}/{champion_mv.version}")
        champ = summary(y, champ_model.predict(rows))
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
