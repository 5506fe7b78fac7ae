"""The judgement of a scored candidate: one assembly for every kind of adapter, so the gate reads the
same measurements whichever stage scored it.

The stages differ in which rows they score (`compare.evaluate`: a slot adapter on its slot's
holdout from the lake; `cold_start.evaluate_stage`: the cold-start student on the held-out cold
users) and agree on everything after: overall metrics and calibration, per slot, cold vs warm,
fairness on gender / age bucket (groups under FAIRNESS_MIN_ROWS left out, with the reason), DeLong's
test against the serving champion, the served pyfunc's latency and the adapter's size, its
interference with the slots' champions. All of it goes to the candidate's training run (metrics +
the HTML report under `evaluation/`), and a JSON-safe summary comes back for the gate and the card.
A value that cannot be measured comes back as None (the gate fails it unless the policy makes it
optional), never as a number that would pass.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.evaluation import report
from pipelines.evaluation.interference import adapter_interference
from pipelines.evaluation.latency import directory_bytes, pyfunc_latency
from pipelines.evaluation.slices import compare_predictions
from pipelines.registry import mlflow_io
from pipelines.registry.models import sibling_champions

# A group's TPR on 15 clicks has a standard error near 0.13: gaps between groups that small are noise
# that the gate would act on. Smaller groups are reported as not included (with the reason).
FAIRNESS_MIN_ROWS = 200


def judge(
    cfg: PipelineConfig,
    candidate: dict,
    rows: pd.DataFrame,
    preds: dict,
    cold: np.ndarray,
    sample: pd.DataFrame,
    *,
    served,
    champion_mv,
    title: str,
    artifact_dir: str = "evaluation",
    metric_prefix: str = "eval",
    step: int | None = None,
) -> tuple[dict, dict]:
    """(summary for the gate, the full comparison) of the candidate scored on `rows`.

    `rows`: the slice columns (user_id, slot, gender, age_bucket, label) of the scored rows; `preds`:
    {"candidate": pCTRs, "champion": pCTRs (absent without a champion)}; `cold`: the cold-user mask;
    `sample`: rows with every column, what the latency is measured on; `served`: the candidate's
    loaded pyfunc (timed as it serves); `champion_mv`: the champion's ModelVersion or None. The report goes
    under `artifact_dir` of the training run, the metrics as `<metric_prefix>_*` at `step` (a judged day's:
    the candidate's shadow metrics, one point per day it waits).
    """
    y = rows["label"].to_numpy(dtype=np.float64)
    comparison = compare_predictions(
        rows, y, preds["candidate"], preds.get("champion"), cold_mask=cold, fairness_min_rows=FAIRNESS_MIN_ROWS
    )
    with tempfile.TemporaryDirectory() as tmp:
        inter = interference(cfg, candidate, tmp)
        # The gate bounds the |cos| of slot adapters; a cold-start student is distilled from the slot
        # champions, so it is aligned with them by construction and the bound does not apply to it.
        inter["bounded"] = candidate["model_name"] in {cfg.adapter_model_name(s) for s in cfg.data.slots}
        size = directory_bytes(f"{tmp}/candidate/artifacts/adapter")
        latency = pyfunc_latency(served, sample)
        comparison.update(latency=latency, adapter_bytes=size, interference=inter)
        paths = report.write_report(
            comparison,
            f"{tmp}/report",
            y=y,
            p_candidate=preds["candidate"],
            p_champion=preds.get("champion"),
            title=title,
        )
        c = mlflow_io.client()
        c.log_artifacts(candidate["run_id"], f"{tmp}/report", artifact_dir)
        c.log_dict(candidate["run_id"], _json_safe(comparison), f"{artifact_dir}/comparison.json")
    result = _summary(
        candidate, comparison, champion_mv, int(len(rows)), sorted(p.rsplit("/", 1)[-1] for p in paths.values() if p)
    )
    _log_metrics(candidate["run_id"], result, metric_prefix, step)
    return result, comparison


def _summary(candidate: dict, comparison: dict, champion_mv, holdout_rows: int, report_files: list[str]) -> dict:
    """The JSON-safe part of a comparison that the gate, the registry tags and the model card read."""
    cand, champ = comparison["candidate"]["overall"], (comparison["champion"] or {}).get("overall")
    cand = {**cand, "gauc": comparison["candidate"]["gauc"]["gauc"]}
    if champ is not None:
        champ = {**champ, "gauc": comparison["champion"]["gauc"]["gauc"]}
    inter = comparison["interference"]
    return {
        "model_name": candidate["model_name"],
        "slot": candidate["slot"],
        "candidate": cand,
        "champion": champ,
        "champion_version": str(champion_mv.version) if champion_mv else None,
        "holdout_rows": holdout_rows,
        "report": compact(comparison, "candidate"),
        "champion_report": compact(comparison, "champion"),
        "delong": comparison["delong"],
        "latency": comparison["latency"],
        "adapter_bytes": comparison["adapter_bytes"],
        "interference": {
            "max_abs_cos": inter.get("max_abs_cos"),
            "pair": inter.get("pair"),
            "module": inter.get("module"),
            "compared": max(len(inter.get("adapters", ())) - 1, 0),
            "bounded": inter.get("bounded"),
        },
        "threshold": comparison["threshold"],
        "report_files": report_files,
    }


def _adapter_dir(model_uri: str, where: str) -> str:
    return mlflow_io.download_artifacts(artifact_uri=model_uri, dst_path=where) + "/artifacts/adapter"


def interference(cfg: PipelineConfig, candidate: dict, tmp: str) -> dict:
    """|cos| between the candidate's LoRA updates and those of the other slots' serving champions on the
    same base (the ones an orthogonality penalty trains against; another base's adapters never serve with it)."""
    dirs = {
        "candidate": _adapter_dir(candidate["model_uri"], f"{tmp}/candidate"),
        **sibling_champions(cfg, candidate["model_name"], tmp, base_fingerprint=candidate["base"]["fingerprint"]),
    }
    return adapter_interference(dirs)


def compact(comparison: dict, who: str) -> dict | None:
    """The slice / fairness part of one model's evaluation that the gate and the model card read."""
    r = comparison.get(who)
    if r is None:
        return None
    fair = {}
    for col, f in r["fairness"].items():
        dp, eo = f["demographic_parity"], f["equalized_odds"]
        fair[col] = {
            "demographic_parity_difference": dp["mean_pctr_gap"],
            "positive_rate_difference": dp["positive_rate_gap"],
            "equalized_odds_difference": eo["equalized_odds_difference"],
        }
    pick = ("auc", "logloss", "ne", "calibration_ratio", "rows")
    cw = r.get("cold_warm") or {}
    return {
        "gauc": r["gauc"]["gauc"],
        "ece": r["overall"].get("ece"),
        "slots": {s: {k: m.get(k) for k in pick} for s, m in r["slots"].items()},
        "cold_warm": {k: {m: cw[k].get(m) for m in pick} for k in ("cold", "warm") if cw.get(k)},
        "fairness": fair,
    }


def _json_safe(obj):
    return json.loads(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _log_metrics(run_id: str, result: dict, prefix: str = "eval", step: int | None = None) -> None:
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
        c.log_metric(run_id, prefix + k[len("eval") :], v, step=step or 0)
