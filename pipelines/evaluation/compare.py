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
"""
from __future__ import annotations

import logging
import tempfile
from collections import Counter

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.errors import PipelineError

log = logging.getLogger(__name__)

SLICE_COLUMNS = ["user_id", "slot", "gender", "age_bucket", "label"]
# A group's TPR on 15 clicks has a standard error near 0.13: gaps between groups that small are noise
# that the gate would act on. Smaller groups are reported as not included (with the reason).
FAIRNESS_MIN_ROWS = 200


def score_holdout(cfg: PipelineConfig, lake_uri: str, candidate: dict, models: dict
                  ) -> tuple[pd.DataFrame, dict, np.ndarray, pd.DataFrame]:
    """(slice columns of every holdout row, {name: pCTR array}, cold-user mask, the first 64 holdout
    rows with every column: what latency is measured on) for pyfunc `models`.

    A holdout row is *cold* when its user has fewer than `cold_start.min_impressions` impressions
    among the window's rows before the holdout (the rows this adapter learned from).
    """
    from pipelines.registry.model_input import predict_pctr
    from pipelines.model.stream import holdout_streams

    streams = holdout_streams(cfg, lake_uri, candidate["end_day"], candidate["slot"], cfg.model)
    sha = streams["index"].lineage()["sha256"]
    if sha != candidate["data"]["sha256"]:
        raise PipelineError(f"the data under {lake_uri} changed between training and evaluation of "
                            f"{candidate['model_name']} (lineage {candidate['data']['sha256'][:12]} != "
                            f"{sha[:12]}); re-run training")
    seen: Counter = Counter()
    for frame in streams["index"].frames(0, streams["holdout"].lo, 262_144, columns=["user_id"]):
        seen.update(_user_keys(frame["user_id"]).tolist())
    parts, preds, sample = [], {k: [] for k in models}, None
    for frame in streams["holdout"].frames():
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


def _adapter_dir(model_uri: str, where: str) -> str:
    import mlflow.artifacts

    return mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=where) + "/artifacts/adapter"


def interference(cfg: PipelineConfig, candidate: dict, tmp: str) -> dict:
    """|cos| between the candidate's LoRA updates and those of the other slots' serving champions."""
    from pipelines.evaluation.interference import adapter_interference
    from pipelines.registry import mlflow_io

    dirs = {"candidate": _adapter_dir(candidate["model_uri"], f"{tmp}/candidate")}
    for slot in cfg.data.slots:
        name = cfg.adapter_model_name(slot)
        mv = mlflow_io.version_by_alias(name, "champion") if name != candidate["model_name"] else None
        if mv is not None:
            dirs[f"{name}:{mv.version}"] = _adapter_dir(f"models:/{name}/{mv.version}", f"{tmp}/{name}")
    return adapter_interference(dirs)


def compact(comparison: dict, who: str) -> dict | None:
    """The slice / fairness part of one model's evaluation that the gate and the model card read."""
    r = comparison.get(who)
    if r is None:
        return None
    fair = {}
    for col, f in r["fairness"].items():
        dp, eo = f["demographic_parity"], f["equalized_odds"]
        fair[col] = {"demographic_parity_difference": dp["mean_pctr_gap"],
                     "positive_rate_difference": dp["positive_rate_gap"],
                     "equalized_odds_difference": eo["equalized_odds_difference"]}
    pick = ("auc", "logloss", "ne", "calibration_ratio", "rows")
    cw = r.get("cold_warm") or {}
    return {"gauc": r["gauc"]["gauc"], "ece": r["overall"].get("ece"),
            "slots": {s: {k: m.get(k) for k in pick} for s, m in r["slots"].items()},
            "cold_warm": {k: {m: cw[k].get(m) for m in pick} for k in ("cold", "warm") if cw.get(k)},
            "fairness": fair}


def evaluate(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    import mlflow

    from pipelines.evaluation import report
    from pipelines.evaluation.latency import directory_bytes, pyfunc_latency
    from pipelines.evaluation.slices import compare_predictions
    from pipelines.registry import mlflow_io

    models = {"candidate": mlflow.pyfunc.load_model(candidate["model_uri"])}
    champion_mv = mlflow_io.version_by_alias(candidate["model_name"], "champion")
    if champion_mv is not None:
        models["champion"] = mlflow.pyfunc.load_model(f"models:/{candidate['model_name']}/{champion_mv.version}")
    rows, preds, cold, sample = score_holdout(cfg, lake_uri, candidate, models)
    y = rows["label"].to_numpy(dtype=np.float64)
    comparison = compare_predictions(rows, y, preds["candidate"], preds.get("champion"), cold_mask=cold,
                                     fairness_min_rows=FAIRNESS_MIN_ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        inter = interference(cfg, candidate, tmp)
        size = directory_bytes(f"{tmp}/candidate/artifacts/adapter")
        latency = pyfunc_latency(models["candidate"], sample)
        comparison.update(latency=latency, adapter_bytes=size, interference=inter)
        paths = report.write_report(comparison, f"{tmp}/report", y=y, p_candidate=preds["candidate"],
                                    p_champion=preds.get("champion"),
                                    title=f"{candidate['model_name']}: candidate vs champion")
        c = mlflow_io.client()
        c.log_artifacts(candidate["run_id"], f"{tmp}/report", "evaluation")
        c.log_dict(candidate["run_id"], _json_safe(comparison), "evaluation/comparison.json")
    cand, champ = comparison["candidate"]["overall"], (comparison["champion"] or {}).get("overall")
    cand = {**cand, "gauc": comparison["candidate"]["gauc"]["gauc"]}
    if champ is not None:
        champ = {**champ, "gauc": comparison["champion"]["gauc"]["gauc"]}
    result = {"model_name": candidate["model_name"], "slot": candidate["slot"], "candidate": cand, "champion": champ,
              "champion_version": str(champion_mv.version) if champion_mv else None, "holdout_rows": int(len(rows)),
              "report": compact(comparison, "candidate"), "champion_report": compact(comparison, "champion"),
              "delong": comparison["delong"], "latency": latency, "adapter_bytes": size,
              "interference": {"max_abs_cos": inter.get("max_abs_cos"), "pair": inter.get("pair"),
                               "module": inter.get("module")},
              "threshold": comparison["threshold"], "report_files": sorted(p.rsplit("/", 1)[-1]
                                                                          for p in paths.values() if p)}
    _log_metrics(candidate["run_id"], result)
    log.info("%s on %d holdout rows (%d cold-user rows):\n%s", candidate["model_name"], len(rows), int(cold.sum()),
             report.format_table(comparison))
    return result


def _json_safe(obj):
    import json

    return json.loads(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _log_metrics(run_id: str, result: dict) -> None:
    from pipelines.registry import mlflow_io

    metrics = {}
    for who in ("candidate", "champion"):
        for k, v in (result[who] or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                metrics[f"eval_{who}_{k}"] = float(v)
    d = result["delong"] or {}
    metrics.update({f"eval_delong_{k}": float(d[k]) for k in ("diff", "p_value", "se") if d.get(k) is not None})
    for b, m in result["latency"].items():
        metrics.update({f"eval_latency_{b}_p50_ms": m["p50_ms"], f"eval_latency_{b}_p99_ms": m["p99_ms"]})
    metrics["eval_adapter_bytes"] = float(result["adapter_bytes"])
    if result["interference"]["max_abs_cos"] is not None:
        metrics["eval_interference_max_abs_cos"] = float(result["interference"]["max_abs_cos"])
    for col, f in (result["report"] or {}).get("fairness", {}).items():
        for k, v in f.items():
            if v is not None:
                metrics[f"eval_fairness_{col}_{k}"] = float(v)
    c = mlflow_io.client()
    for k, v in metrics.items():
        c.log_metric(run_id, k, v)
