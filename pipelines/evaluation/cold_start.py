"""Stage: the cold-start student judged on held-out cold users (see training.cold_start).

The slot champions as they serve those rows today, the no-distillation baseline, the distilled
student and the serving base alone are all scored on the same rows; for the gate the student is the
candidate and the serving `<model_name>@champion` the champion (None on the first run). The student
is then judged like any other candidate (`evaluation.judge`, as `compare.evaluate` does): fairness,
calibration, per slot, DeLong against the champion, the served pyfunc's latency and the adapter's
size, so the gate measures the same checks on it (an unmeasured one fails, issue 13).
"""

from __future__ import annotations

import logging

import numpy as np

from pipelines.config import PipelineConfig
from pipelines.data.cold import base_of, prepare, same_data, slots_of
from pipelines.errors import PipelineError
from pipelines.evaluation import report
from pipelines.evaluation.judge import judge
from pipelines.metrics import sigmoid
from pipelines.metrics import summary as metric_summary
from pipelines.model import adapters, family, features, inference
from pipelines.model.inference import predict
from pipelines.registry import mlflow_io, pyfunc
from pipelines.registry.model_input import predict_pctr
from pipelines.registry.models import BASELINE_ARTIFACT, load_teachers
from pipelines.registry.pyfunc import load_base_from_registry

log = logging.getLogger(__name__)


def evaluate_stage(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    """AUC / logloss on the held-out cold users of (a) the slot champions as they serve those rows
    today (`champions`), (b) the no-distillation baseline and (c) the distilled student, plus the
    serving base alone (`base`), logged to the student's run (`eval_<who>_<metric>`).

    For the gate, `candidate` is the student and `champion` is the serving `<model_name>@champion`
    on the same rows (None on the first run: absolute thresholds). The slot champions are reported,
    not gated against: they usually trained on part of the held-out users' rows (`teacher_saw_holdout`).
    The rest of the result is `evaluation.judge`'s, the keys `compare.evaluate` returns (`report`,
    `champion_report`, `delong`, `latency`, `adapter_bytes`, `interference`, ...).
    """
    slot, name = candidate["slot"], candidate["model_name"]
    prep = prepare(cfg, lake_uri, candidate["end_day"], slot, base=base_of(candidate))
    same_data(prep, candidate, "evaluation")
    rows = prep.split.holdout
    if len(rows) != candidate["rows"]["holdout"] or prep.split.holdout_start != candidate["holdout_start"]:
        raise PipelineError(
            f"the held-out cold rows differ from the ones distillation set aside ({len(rows)} rows from "
            f"{prep.split.holdout_start} vs {candidate['rows']['holdout']} from "
            f"{candidate['holdout_start']}): the cold_start config changed between tasks; re-run the DAG"
        )
    y = features.labels(rows)
    served = pyfunc.load(candidate["model_uri"])  # the student as it will serve: scored and timed through it
    preds = {"candidate": predict_pctr(served, rows)}
    cold_slice = _score_cold_slice(cfg, prep, rows, y, candidate, preds["candidate"])
    champion_mv, p_champion = _score_serving_champion(name, rows)
    if p_champion is not None:
        preds["champion"] = p_champion
    # Every held-out row is a cold user's (the split holds out cold users only): the cold mask is all True.
    judged, comparison = judge(
        cfg,
        candidate,
        rows,
        preds,
        np.ones(len(rows), dtype=bool),
        rows.head(64),
        served=served,
        champion_mv=champion_mv,
        title=f"{name}: cold-start student vs champion on held-out cold users",
    )
    start_day = candidate["holdout_start"][:10]
    saw = sorted(s for s, r in candidate["teachers"].items() if r.get("data_last") and r["data_last"] >= start_day)
    result = {
        **judged,
        "holdout_users": candidate["holdout_users"],
        "holdout_start": candidate["holdout_start"],
        "cold_slice": cold_slice,
        "teacher": candidate["teacher"]["kind"],
        "teacher_saw_holdout": saw,
    }
    _log_to_run(candidate["run_id"], result)
    _log_summary(result, start_day)
    log.info("%s judged like any candidate on the held-out cold rows:\n%s", name, report.format_table(comparison))
    return result


def _score_cold_slice(cfg: PipelineConfig, prep, rows, y, candidate: dict, p_student) -> dict:
    """Metric summaries on the held-out rows of the slot champions (as they serve the rows today), the
    no-distillation baseline, the student (`p_student`: through its served pyfunc) and the serving base alone."""
    teachers, _ = load_teachers(cfg, slots_of(cfg, candidate["slot"]), refs=candidate["teachers"], base=prep.base)
    x = family.encode(rows, teachers[None].cfg)
    t_logits, _ = inference.forward_by_group(teachers, x, rows["slot"].astype(str).to_numpy())
    base_only = metric_summary(y, predict(teachers[None], x))  # for reference: the serving base alone
    del teachers
    champions = metric_summary(y, sigmoid(t_logits))
    b = candidate["base"]
    local = mlflow_io.download_artifacts(run_id=candidate["run_id"], artifact_path=BASELINE_ARTIFACT)
    baseline = metric_summary(
        y, predict(adapters.load(load_base_from_registry(b["name"], b["version"], b["fingerprint"]), local), x)
    )
    student = metric_summary(y, p_student)
    return {"champions": champions, "baseline": baseline, "student": student, "base": base_only}


def _score_serving_champion(name: str, rows):
    """(`name`@champion's model version, its pCTRs on the held-out rows); (None, None) on the first run."""
    champion_mv = mlflow_io.version_by_alias(name, "champion")
    if champion_mv is None:
        return None, None
    return champion_mv, predict_pctr(pyfunc.load(f"models:/{name}/{champion_mv.version}"), rows)


def _log_to_run(run_id: str, result: dict) -> None:
    """The cold-slice scores as `eval_<who>_<metric>` on the student's run (`judge` logged the candidate's
    and the champion's), and the whole result as a JSON artifact."""
    c = mlflow_io.client()
    for who, m in result["cold_slice"].items():
        for k, v in (m or {}).items():
            if isinstance(v, (int, float)) and v is not None:
                c.log_metric(run_id, f"eval_{who}_{k}", float(v))
    c.log_dict(run_id, result, "cold_start/evaluation.json")


def _fmt(m: dict | None) -> str:
    return "n/a" if m is None or m["auc"] is None else f"AUC {m['auc']:.4f} logloss {m['logloss']:.4f}"


def _log_summary(result: dict, start_day: str) -> None:
    name, scores, saw, champion = (
        result["model_name"],
        result["cold_slice"],
        result["teacher_saw_holdout"],
        result["champion"],
    )
    log.info(
        "%s on %d rows of %d held-out cold users: slot champions %s | baseline %s | student %s | base %s | "
        "%s@champion %s%s",
        name,
        result["holdout_rows"],
        result["holdout_users"],
        _fmt(scores["champions"]),
        _fmt(scores["baseline"]),
        _fmt(scores["student"]),
        _fmt(scores["base"]),
        name,
        f"v{result['champion_version']} {_fmt(champion)}" if champion else "none (first run)",
        f" (the champions of {saw} trained on data up to or past the holdout start {start_day}: their numbers "
        f"are optimistic)"
        if saw
        else "",
    )
