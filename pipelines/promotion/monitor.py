"""After release: watch `@champion` and `@canary` of every adapter on each newly validated day.

One *window* = one model version scored on the labelled rows of one daily partition that validation
marked `passed` (delayed feedback: a day's labels arrive with its partition), plus live metrics of
that version over that day when a source is set (`live_metrics`). Each window is a run in the MLflow
experiment `ctr-monitor` (tags model, alias, version, day; metrics rows, auc, logloss, ctr = observed
click rate, mean_pctr, live_*). A version is scored once per day, in the role it had at the day's
first run: re-running a day reuses its windows (a partition rewritten since replaces them). A day
a version was trained on (<= its `data.last`) is in-sample and is not scored for it.

Decisions (pure functions of the windows, in `pipelines.promotion.monitor_decisions`): `canary_decision`
promotes, withdraws or keeps waiting on the canary; `revert_decision` reverts a champion whose metric
stays below its reference (the holdout AUC at registration, or the live CTR of its first window).

Canary moves are made here (deterministic op ids: a re-run moves nothing twice); reverts are
returned for the DAG's revert operator, or made here with `apply_reverts=True` (CLI path).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import mlflow
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.data.lake import Lake
from pipelines.errors import ConfigError, LakeError, PipelineError
from pipelines.metrics import summary
from pipelines.promotion import aliases
from pipelines.promotion.monitor_decisions import (
    REVERT_KEYS,
    Decision,
    Window,
    canary_decision,
    ordered,
    reference_value,
    revert_decision,
)
from pipelines.registry import mlflow_io, pyfunc
from pipelines.registry.lock import registry_lock
from pipelines.registry.model_input import predict_pctr
from pipelines.validation.stage import read_marker

log = logging.getLogger(__name__)

EXPERIMENT = "ctr-monitor"
ACTOR = "ctr_champion_monitor"
WINDOW_METRICS = ("rows", "auc", "logloss", "ctr", "mean_pctr")


# ----------------------------------------------------------------------------- records
def _metrics(logged: dict) -> dict:
    # MLflow stores every metric as a float; a row count reads back as the integer it is.
    return {k: int(v) if k == "rows" else v for k, v in logged.items()}


def load_windows(model: str) -> list[Window]:
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        return []
    runs = mlflow.search_runs(
        experiment_names=[EXPERIMENT], filter_string=f"tags.model = '{model}'", output_format="list", max_results=50000
    )
    return ordered(
        Window(
            model=model,
            alias=r.data.tags.get("alias", ""),
            version=r.data.tags.get("version", ""),
            day=r.data.tags.get("day", ""),
            metrics=_metrics(r.data.metrics),
            champion_version=r.data.tags.get("champion_version", ""),
            order=int(r.info.start_time),
            run_id=r.info.run_id,
            sha256=r.data.tags.get("data.sha256", ""),
        )
        for r in runs
    )


def record_window(w: Window) -> Window:
    c = mlflow_io.client()
    tags = {
        "model": w.model,
        "alias": w.alias,
        "version": w.version,
        "day": w.day,
        "data.sha256": w.sha256,
        "champion_version": w.champion_version,
    }
    run = c.create_run(
        mlflow_io.ensure_experiment(EXPERIMENT), tags=tags, run_name=f"{w.model}@{w.alias} v{w.version} dt={w.day}"
    )
    now = int(time.time() * 1000)
    c.log_batch(run.info.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in w.metrics.items() if v is not None])
    c.set_terminated(run.info.run_id)
    return replace(w, order=int(run.info.start_time), run_id=run.info.run_id)


def _live(live, model: str, version: str, day: str) -> dict:
    if live is None:
        return {}
    try:
        got = live.window_metrics(model, version, day) or {}
    except Exception as exc:  # an outside system: its failure is "no live metrics", never a bad window
        log.warning("no live metrics for %s v%s dt=%s: %s: %s", model, version, day, type(exc).__name__, exc)
        return {}
    return {(k if k.startswith("live_") else f"live_{k}"): float(v) for k, v in got.items() if v is not None}


class Scorer:
    """Scores rows with registered versions, each pyfunc loaded once per Scorer (a monitor run, a backtest replay)."""

    def __init__(self):
        self._models: dict = {}

    def predict(self, model: str, version: str, rows):
        if (model, version) not in self._models:
            self._models[model, version] = pyfunc.load(f"models:/{model}/{version}")
        return predict_pctr(self._models[model, version], rows)


def window(
    model: str,
    alias: str,
    mv,
    day: str,
    rows,
    sha256: str,
    past: list[Window],
    live,
    scorer: Scorer,
    champion_version: str = "",
) -> tuple[Window | None, str]:
    """The window of `mv` on `day`: found (a version is scored once per day, in the role it had then),
    or scored and recorded as model@alias; (None, why) when the day is in-sample for it."""
    version, trained_to = str(mv.version), mv.tags.get("data.last", "")
    if trained_to and day <= trained_to:
        return None, f"v{version} was trained on data up to {trained_to}: dt={day} is in-sample"
    found = [w for w in past if (w.version, w.day) == (version, day)]
    if found:
        return found[-1], f"recorded earlier as {found[-1].alias}"
    y = rows["label"].to_numpy(dtype="float64")
    s = summary(y, scorer.predict(model, version, rows))
    metrics = {**{k: s[k] for k in WINDOW_METRICS}, **_live(live, model, version, day)}
    w = Window(
        model=model,
        alias=alias,
        version=version,
        day=day,
        metrics=metrics,
        champion_version=champion_version,
        sha256=sha256,
    )
    return record_window(w), "scored"


def drop_stale(past: list[Window], day: str, sha256: str) -> list[Window]:
    """Windows of `day` scored on other content (the partition was rewritten, e.g. late labels) no
    longer stand: deleted, so the day is scored again on what validation passed."""
    for w in past:
        if w.day == day and w.sha256 != sha256:
            mlflow_io.client().delete_run(w.run_id)
    return [w for w in past if w.day != day or w.sha256 == sha256]


# ----------------------------------------------------------------------------- one day
def monitored_models(cfg: PipelineConfig) -> list[tuple[str, str | None]]:
    """(registered model, slot whose rows it serves; None = every row) for each adapter family."""
    return [(cfg.adapter_model_name(s), s) for s in cfg.data.slots] + [(cfg.cold_start.model_name, None)]


def usable_partition(lake, day: str):
    """(the day's partition, "") when validation passed it and it is unchanged since, else (None, why)."""
    marker = read_marker(lake, day)
    if marker is None:
        return None, f"dt={day} has no validation marker (not validated yet)"
    if marker.get("status") != "passed":
        return None, f"dt={day} was {marker.get('status')!r} by validation, not 'passed'"
    try:
        part = lake.read_partition(day)
    except LakeError as exc:
        return None, f"dt={day} is not readable: {exc}"
    if marker.get("sha256") != part.sha256:
        return None, (
            f"dt={day} changed since it was validated (sha256 {str(marker.get('sha256'))[:12]} -> "
            f"{part.sha256[:12]}): validate it again"
        )
    return part, ""


def monitor_model(
    model: str, slot: str | None, part, day: str, policy: GatePolicy, live, actor: str, scorer: Scorer
) -> dict:
    out: dict = {
        "model": model,
        "slot": slot,
        "day": day,
        "champion": None,
        "canary": None,
        "windows": {},
        "skipped": {},
        "reference": None,
        "canary_decision": None,
        "revert_decision": None,
        "revert": None,
        "moves": [],
    }
    champion = mlflow_io.version_by_alias(model, "champion")
    if champion is None:
        out["skipped"]["model"] = f"{model} has no @champion"
        return out
    canary = mlflow_io.version_by_alias(model, "canary")
    out["champion"], out["canary"] = str(champion.version), (str(canary.version) if canary else None)
    rows = part.frame if slot is None else part.frame[part.frame["slot"] == slot]
    if rows.empty:
        out["skipped"]["model"] = f"no rows of slot {slot!r} on dt={day}"
        return out
    # Serialises two monitors of one model (find-or-record, then decide) without blocking alias moves.
    with registry_lock(f"{EXPERIMENT}:{model}"):
        past = drop_stale(load_windows(model), day, part.sha256)
        scored = [("champion", champion, "")] + (
            [("canary", canary, out["champion"])] if canary and out["canary"] != out["champion"] else []
        )
        for alias, mv, vs in scored:
            w, why = window(model, alias, mv, day, rows, part.sha256, past, live, scorer, champion_version=vs)
            if w is None:
                out["skipped"][alias] = why
            else:
                out["windows"][alias] = {"version": w.version, "how": why, "run_id": w.run_id, **w.metrics}
        windows = [w for w in load_windows(model) if w.day <= day]
    ref, source = reference_value(policy, dict(champion.tags), windows, out["champion"])
    out["reference"] = {"metric": REVERT_KEYS[policy.revert_metric], "value": ref, "source": source}
    rev = revert_decision(windows, ref, policy, version=out["champion"])
    out["revert_decision"] = rev.to_dict()
    if rev.action == "revert":
        target = aliases.previous_champion(model)
        if target is None:
            raise PipelineError(f"{model}: revert due ({rev.reason}) but there is no earlier champion to revert to")
        out["revert"] = {"model": model, "to_version": target, "reason": f"auto-revert by the monitor: {rev.reason}"}
    if canary is None or out["canary"] == out["champion"]:
        return out
    can = canary_decision(windows, policy, canary_version=out["canary"], champion_version=out["champion"])
    if rev.action == "revert" and can.action != "withdraw":
        can = Decision("wait", f"held: champion v{out['champion']} is being reverted ({can.action}: {can.reason})")
    out["canary_decision"] = can.to_dict()
    op = f"monitor/{model}/{day}/{can.action}-canary/v{out['canary']}"
    if can.action == "promote":
        out["moves"].append(
            aliases.promote_canary(
                model, reason=f"monitor: {can.reason}", actor=actor, op_id=op, expected_version=out["canary"]
            )
        )
    elif can.action == "withdraw":
        out["moves"].append(aliases.withdraw_canary(model, reason=f"monitor: {can.reason}", actor=actor, op_id=op))
    return out


def monitor_day(
    cfg: PipelineConfig,
    policy: GatePolicy,
    lake_uri: str,
    day: str,
    *,
    live=None,
    actor: str = ACTOR,
    apply_reverts: bool = False,
) -> dict:
    """Score, record and decide for every monitored model on the labelled partition of `day`.

    Returns a JSON-safe dict: per model its windows, skips, decisions and moves; `reverts` (the
    [{model, to_version, reason}] due, for the revert operator); `errors` (models that could not be
    monitored: the others still are). `apply_reverts`: make the reverts here (CLI, no Airflow).
    """
    if policy.revert_metric == "ctr" and live is None:
        raise ConfigError(
            "gate.revert_metric is 'ctr' (the live CTR of a version) but no live-metrics source is "
            "configured (gate.live_metrics_url is empty); labelled partitions cannot measure it. "
            "Set gate.live_metrics_url or use revert_metric: auc"
        )
    result: dict = {
        "day": day,
        "lake": lake_uri,
        "partition": None,
        "skipped": None,
        "models": [],
        "reverts": [],
        "applied_reverts": [],
        "errors": [],
    }
    part, why = usable_partition(Lake(lake_uri), day)
    if part is None:
        result["skipped"] = why
        log.warning("monitor dt=%s: nothing scored: %s", day, why)
        return result
    result["partition"] = {"sha256": part.sha256, "rows": int(len(part.frame))}
    scorer = Scorer()
    for model, slot in monitored_models(cfg):
        try:
            out = monitor_model(model, slot, part, day, policy, live, actor, scorer)
        except (PipelineError, MlflowException) as exc:  # one broken model must not blind the others
            log.error("monitor dt=%s: %s could not be monitored: %s", day, model, exc)
            result["errors"].append({"model": model, "error": f"{type(exc).__name__}: {exc}"})
            continue
        result["models"].append(out)
        if out["revert"]:
            result["reverts"].append(out["revert"])
    if apply_reverts:
        for r in result["reverts"]:
            try:
                move = aliases.revert(
                    r["model"],
                    reason=r["reason"],
                    to_version=r["to_version"],
                    actor=actor,
                    op_id=f"monitor/{r['model']}/{day}/revert-to/v{r['to_version']}",
                )
                result["applied_reverts"].append(move)
            except PipelineError as exc:
                result["errors"].append({"model": r["model"], "error": f"revert refused: {exc}"})
    log.info("champion monitor dt=%s (%d rows of %s):\n%s", day, len(part.frame), lake_uri, format_table(result))
    return result


def monitor_days(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, days: list[str], **kwargs) -> dict:
    """`monitor_day` for each of `days`, oldest first (a run that consumed several validated days):
    every day is one window, as if each had had a run of its own. One result: the models' entries and
    errors of all days, each model's first revert due (later days decide on the champion the first
    revert replaces, so theirs would target the same version), `days` the days scored."""
    results = [monitor_day(cfg, policy, lake_uri, d, **kwargs) for d in sorted(set(days))]
    if len(results) == 1:
        return results[0]
    merged = {
        **results[-1],
        "days": [r["day"] for r in results],
        "reverts": [],
        "models": [m for r in results for m in r["models"]],
        "applied_reverts": [m for r in results for m in r["applied_reverts"]],
        "errors": [e for r in results for e in r["errors"]],
    }
    for revert in (rv for r in results for rv in r["reverts"]):
        if revert["model"] not in {x["model"] for x in merged["reverts"]}:
            merged["reverts"].append(revert)
    return merged


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def format_table(result: dict) -> str:
    """One line per model: versions, window AUCs, both decisions and why."""
    head = ["model", "champion", "canary", "rows", "champ AUC", "canary AUC", "canary", "revert", "why"]
    lines = [head]
    for m in result["models"]:
        ch, ca = m["windows"].get("champion") or {}, m["windows"].get("canary") or {}
        cd, rd = m["canary_decision"] or {}, m["revert_decision"] or {}
        why = "; ".join(
            filter(None, [*(f"{k}: {v}" for k, v in m["skipped"].items()), cd.get("reason"), rd.get("reason")])
        )
        lines.append(
            [
                m["model"],
                _fmt(m["champion"]),
                _fmt(m["canary"]),
                _fmt(ch.get("rows")),
                _fmt(ch.get("auc")),
                _fmt(ca.get("auc")),
                cd.get("action", "-"),
                rd.get("action", "-"),
                why,
            ]
        )
    lines += [[e["model"], "-", "-", "-", "-", "-", "error", "-", e["error"]] for e in result["errors"]]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(len(widths))) + "  " + r[-1] for r in lines)
