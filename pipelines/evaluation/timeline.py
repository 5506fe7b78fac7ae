"""How a slot is doing over days, as MLflow draws it: one long-lived run per adapter model (experiment
`ctr-slot-timeline`, run "<model> over days") to which every judged day adds the serving champion's and the
judged candidate's AUC and calibration on that day's rows, with the day as the step and as the timestamp.

MLflow's chart view draws one point per run for a metric logged once, so the per-candidate shadow metrics (on
each candidate's own training run) make bar charts; a series logged into one run at increasing steps is a line.
Pick the run in the experiment and open its Model metrics (or chart the experiment's runs): `champion_auc` and
`candidate_auc` over days, `champion_version` where the champion changed. The x-axis "Step" is days since
1970-01-01; "Time" shows the day itself.
"""

from __future__ import annotations

import datetime as dt

from mlflow.entities import Metric, RunStatus

from pipelines.registry import mlflow_io

EXPERIMENT = "ctr-slot-timeline"
MODEL_TAG = "timeline.model"
FIGURES = ("auc", "calibration_ratio", "ece", "logloss", "rows")


def day_step(day: str) -> int:
    """A day as an MLflow metric step: days since 1970-01-01."""
    return (dt.date.fromisoformat(day) - dt.date(1970, 1, 1)).days


def points(day: str, figures: dict[str, dict | None], versions: dict[str, str]) -> list[tuple[str, float, int, int]]:
    """(metric, value, timestamp ms, step) of one day (pure): each role's ("champion", "canary", "candidate")
    figures and its version number."""
    ts = int(dt.datetime.fromisoformat(day).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    out = []
    for role, figs in figures.items():
        for k in FIGURES:
            v = (figs or {}).get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((f"{role}_{k}", float(v), ts, day_step(day)))
        if versions.get(role):
            out.append((f"{role}_version", float(versions[role]), ts, day_step(day)))
    return out


def record(model: str, slot: str, day: str, judged: list[tuple[str, dict | None]]) -> str:
    """Add `day` to `model`'s timeline: each (version, figures) of `judged`, labelled by what the version is now
    (`champion`, `canary`, else `candidate`; the caller leaves out a replaced champion). Returns the run's id."""
    serving = {
        alias: str(mv.version)
        for alias in ("champion", "canary")
        if (mv := mlflow_io.version_by_alias(model, alias)) is not None
    }
    figures, versions = {}, {}
    for version, figs in judged:
        role = next((a for a, v in serving.items() if v == str(version)), "candidate")
        if role not in figures:
            figures[role], versions[role] = figs, str(version)
    c = mlflow_io.client()
    run_id = run_of(model, slot)
    c.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in points(day, figures, versions)])
    c.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))  # not a hung run; later days log on
    return run_id


def run_of(model: str, slot: str) -> str:
    """The timeline run of `model`, created on its first day; with two (a race), the oldest."""
    c = mlflow_io.client()
    exp = mlflow_io.ensure_experiment(EXPERIMENT)
    found = c.search_runs(
        [exp], filter_string=f"tags.`{MODEL_TAG}` = '{model}'", order_by=["attributes.start_time ASC"], max_results=1
    )
    if found:
        return found[0].info.run_id
    run = c.create_run(exp, run_name=f"{model} over days", tags={MODEL_TAG: model, "slot": slot})
    return run.info.run_id
