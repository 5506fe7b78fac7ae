"""After release: watch `@champion` and `@canary` of every adapter on each newly validated day.

One *window* = one model version scored on the labelled rows of one daily partition that validation
marked `passed` (delayed feedback: the labels of a day arrive with its partition), optionally with
live metrics of that version over that day (`live_metrics`). Each window is a run in the MLflow
experiment `ctr-monitor` (tags model, alias, version, day; metrics rows, auc, logloss, ctr = observed
click rate, mean_pctr, live_*). A window is recorded once: re-running a day finds its runs and
reuses them (a partition rewritten since, e.g. late labels, replaces its windows).

A version is only scored on days after its training data (`data.last`): the day it was trained on
is in-sample and would flatter it.

Decisions (pure functions of the windows, `canary_decision`, `revert_decision`):

* canary: `promote` after `canary_healthy_windows` windows of the current (canary, champion) pair
  with canary AUC >= champion AUC - `canary_auc_tolerance` on the same rows; `withdraw` as soon as
  the latest window is below that; else `wait`.
* revert: the champion's metric below reference x (1 - `revert_drop`) in its last `revert_windows`
  measured windows (windows of the current version since it became champion) => revert to the
  previous champion. Metric `auc`: reference = the AUC recorded at registration on the holdout
  (`eval.candidate`, what the gate accepted), else its first monitored window. Metric `ctr`: the
  *live* CTR (`live_ctr`) against its first measured window; the CTR of a labelled partition is
  what was served to users, whatever a model scores now, so it cannot judge a version, and
  `revert_metric: ctr` without a live source is a config error. A window without the metric (live
  source down, a day of one class) is no evidence either way: it neither counts nor breaks a streak.
  A revert due holds the canary's decision (its pair restarts against the restored champion).

Canary moves are made here (`aliases`, deterministic op ids: a re-run moves nothing twice). Reverts
are returned for the DAG's revert operator; `apply_reverts=True` (the CLI path) makes them here.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.errors import ConfigError, LakeError, PipelineError

log = logging.getLogger(__name__)

EXPERIMENT = "ctr-monitor"
ACTOR = "ctr_champion_monitor"
WINDOW_METRICS = ("rows", "auc", "logloss", "ctr", "mean_pctr")
REVERT_KEYS = {"auc": "auc", "ctr": "live_ctr"}


@dataclass(frozen=True)
class Window:
    """model@alias (version) scored on the labelled rows of `day`; a metric that is None is unknown."""
    model: str
    alias: str                      # "champion" | "canary"
    version: str
    day: str
    metrics: dict = field(default_factory=dict)
    champion_version: str = ""      # canary windows: the champion scored on the same rows
    order: int = 0                  # when it was recorded (ms): orders two windows of one day
    run_id: str = ""
    sha256: str = ""                # content hash of the partition it was scored on

    def value(self, key: str) -> float | None:
        v = self.metrics.get(key)
        return None if v is None or not math.isfinite(float(v)) else float(v)


@dataclass(frozen=True)
class Decision:
    action: str                     # canary: promote | withdraw | wait; revert: revert | keep
    reason: str
    days: tuple[str, ...] = ()      # the windows the decision rests on


def _ordered(windows: Iterable[Window]) -> list[Window]:
    return sorted(windows, key=lambda w: (w.day, w.order))


# ----------------------------------------------------------------------------- decisions (pure)
def canary_pairs(windows: Iterable[Window]) -> list[tuple[Window, Window]]:
    """(canary, champion) windows scored on the same day's rows, both with an AUC, oldest first."""
    windows = list(windows)
    champions = {(w.day, w.version): w for w in _ordered(windows) if w.alias == "champion"}
    pairs = []
    for c in _ordered(w for w in windows if w.alias == "canary"):
        ch = champions.get((c.day, c.champion_version))
        if ch is not None and c.value("auc") is not None and ch.value("auc") is not None:
            pairs.append((c, ch))
    return pairs


def canary_decision(windows: Iterable[Window], policy: GatePolicy, canary_version: str | None = None,
                    champion_version: str | None = None) -> Decision:
    """promote / withdraw / wait for the current pair (default: the latest paired window's)."""
    pairs = canary_pairs(windows)
    if canary_version is not None:
        pairs = [p for p in pairs if p[0].version == str(canary_version)]
    if champion_version is not None:
        pairs = [p for p in pairs if p[1].version == str(champion_version)]
    if not pairs:
        return Decision("wait", "no window yet with both canary and champion scored on the same rows")
    cv, chv = pairs[-1][0].version, pairs[-1][1].version
    run: list[tuple[Window, Window]] = []
    for c, ch in reversed(pairs):  # the windows since this pair began (a champion change restarts it)
        if (c.version, ch.version) != (cv, chv):
            break
        run.insert(0, (c, ch))
    tol, need = policy.canary_auc_tolerance, policy.canary_healthy_windows

    def healthy(p: tuple[Window, Window]) -> bool:
        return p[0].value("auc") >= p[1].value("auc") - tol

    def show(p: tuple[Window, Window]) -> str:
        return f"dt={p[0].day} {p[0].value('auc'):.4f} vs {p[1].value('auc'):.4f}"

    if not healthy(run[-1]):
        return Decision("withdraw", f"canary v{cv} AUC {run[-1][0].value('auc'):.4f} < champion v{chv} AUC "
                                    f"{run[-1][1].value('auc'):.4f} - tolerance {tol:g} on dt={run[-1][0].day}",
                        (run[-1][0].day,))
    streak = 0
    for p in reversed(run):
        if not healthy(p):
            break
        streak += 1
    days = tuple(p[0].day for p in run[-min(streak, need):])
    if streak >= need:
        return Decision("promote", f"canary v{cv} AUC >= champion v{chv} AUC - {tol:g} in {need} consecutive "
                                   "windows (canary vs champion): " + ", ".join(show(p) for p in run[-need:]), days)
    return Decision("wait", f"{streak}/{need} healthy windows of canary v{cv} vs champion v{chv}: "
                            + ", ".join(show(p) for p in run[-streak:]), days)


def revert_decision(windows: Iterable[Window], reference: float | None, policy: GatePolicy,
                    version: str | None = None) -> Decision:
    """revert when the champion's metric is below reference x (1 - revert_drop) in each of its last
    `revert_windows` measured windows since it became champion; else keep."""
    key, k = REVERT_KEYS[policy.revert_metric], policy.revert_windows
    champ = _ordered(w for w in windows if w.alias == "champion")
    if not champ:
        return Decision("keep", "no champion window yet")
    version = str(version) if version is not None else champ[-1].version
    run: list[Window] = []
    for w in reversed(champ):      # a different version in between means it was champion again later
        if w.version != version:
            break
        run.insert(0, w)
    if reference is None:
        return Decision("keep", f"no reference {key} for champion v{version} yet")
    floor = reference * (1.0 - policy.revert_drop)
    measured = [(w, w.value(key)) for w in run if w.value(key) is not None]
    streak = 0
    for _, v in reversed(measured):
        if v >= floor:
            break
        streak += 1
    shown = ", ".join(f"dt={w.day} {v:.4f}" for w, v in measured[-min(max(streak, 1), k):])
    where = (f"champion v{version} {key} below {floor:.4f} (= reference {reference:.4f} x (1 - {policy.revert_drop:g}))")
    if streak >= k:
        return Decision("revert", f"{where} in {k} consecutive windows: {shown}",
                        tuple(w.day for w, _ in measured[-k:]))
    return Decision("keep", f"{streak}/{k} windows {where}" + (f"; latest: {shown}" if measured else ""))


def reference_value(policy: GatePolicy, version_tags: dict, windows: Iterable[Window], version: str
                    ) -> tuple[float | None, str]:
    """(reference of the revert metric for `version`, where it comes from)."""
    key = REVERT_KEYS[policy.revert_metric]
    if key == "auc":
        try:
            auc = json.loads(version_tags.get("eval.candidate") or "null")["auc"]
            if auc is not None and math.isfinite(float(auc)):
                return float(auc), "eval.candidate (holdout AUC at registration)"
        except (TypeError, KeyError, ValueError):
            pass   # tag missing or not the registration's JSON: fall back to the first window
    first = next((w for w in _ordered(windows) if w.version == str(version) and w.value(key) is not None), None)
    if first is None:
        return None, "none yet"
    return first.value(key), f"first monitored window dt={first.day} ({first.alias})"


# ----------------------------------------------------------------------------- records
def load_windows(model: str) -> list[Window]:
    import mlflow

    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        return []
    runs = mlflow.search_runs(experiment_names=[EXPERIMENT], filter_string=f"tags.model = '{model}'",
                              output_format="list", max_results=50000)
    return _ordered(Window(model=model, alias=r.data.tags.get("alias", ""), version=r.data.tags.get("version", ""),
                           day=r.data.tags.get("day", ""), metrics=dict(r.data.metrics),
                           champion_version=r.data.tags.get("champion_version", ""), order=int(r.info.start_time),
                           run_id=r.info.run_id, sha256=r.data.tags.get("data.sha256", "")) for r in runs)


def record_window(w: Window) -> Window:
    import time

    from mlflow.entities import Metric

    from pipelines.registry import mlflow_io

    c = mlflow_io.client()
    tags = {"model": w.model, "alias": w.alias, "version": w.version, "day": w.day, "data.sha256": w.sha256,
            "champion_version": w.champion_version}
    run = c.create_run(mlflow_io.ensure_experiment(EXPERIMENT), tags=tags,
                       run_name=f"{w.model}@{w.alias} v{w.version} dt={w.day}")
    now = int(time.time() * 1000)
    c.log_batch(run.info.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in w.metrics.items() if v is not None])
    c.set_terminated(run.info.run_id)
    return Window(**{**asdict(w), "order": int(run.info.start_time), "run_id": run.info.run_id})


def _live(live, model: str, version: str, day: str) -> dict:
    if live is None:
        return {}
    try:
        got = live.window_metrics(model, version, day) or {}
    except Exception as exc:   # an outside system: its failure is "no live metrics", never a bad window
        log.warning("no live metrics for %s v%s dt=%s: %s: %s", model, version, day, type(exc).__name__, exc)
        return {}
    return {(k if k.startswith("live_") else f"live_{k}"): float(v) for k, v in got.items() if v is not None}


class _Scorer:
    """Loaded pyfuncs, once per version per monitor run."""

    def __init__(self):
        self._models: dict = {}

    def predict(self, model: str, version: str, rows):
        import mlflow.pyfunc
        import numpy as np

        from pipelines.data.schema import FEATURE_FIELDS

        if (model, version) not in self._models:
            self._models[model, version] = mlflow.pyfunc.load_model(f"models:/{model}/{version}")
        return np.asarray(self._models[model, version].predict(rows.loc[:, list(FEATURE_FIELDS)]), dtype=np.float64)


def window(model: str, alias: str, mv, day: str, rows, sha256: str, past: list[Window], live, scorer: _Scorer,
           champion_version: str = "") -> tuple[Window | None, str]:
    """The recorded window of model@alias on `day` (found, or scored and recorded), or (None, why not)."""
    from pipelines.evaluation.metrics import summary
    from pipelines.registry import mlflow_io

    version, trained_to = str(mv.version), mv.tags.get("data.last", "")
    if trained_to and day <= trained_to:
        return None, f"v{version} was trained on data up to {trained_to}: dt={day} is in-sample"
    same = [w for w in past if (w.alias, w.version, w.day, w.champion_version) == (alias, version, day, champion_version)]
    current = [w for w in same if w.sha256 == sha256]
    if current:
        return current[-1], "recorded earlier"
    for w in same:   # the partition changed since (e.g. late labels): its old window no longer stands
        mlflow_io.client().delete_run(w.run_id)
    y = rows["label"].to_numpy(dtype="float64")
    s = summary(y, scorer.predict(model, version, rows))
    metrics = {**{k: s[k] for k in WINDOW_METRICS}, **_live(live, model, version, day)}
    w = Window(model=model, alias=alias, version=version, day=day, metrics=metrics,
               champion_version=champion_version, sha256=sha256)
    return record_window(w), "scored"


# ----------------------------------------------------------------------------- one day
def monitored_models(cfg: PipelineConfig) -> list[tuple[str, str | None]]:
    """(registered model, slot whose rows it serves; None = every row) for each adapter family."""
    return [(cfg.adapter_model_name(s), s) for s in cfg.data.slots] + [(cfg.cold_start.model_name, None)]


def usable_partition(lake, day: str):
    """(the day's partition, "") when validation passed it and it is unchanged since, else (None, why)."""
    from pipelines.validation.stage import read_marker

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
        return None, (f"dt={day} changed since it was validated (sha256 {str(marker.get('sha256'))[:12]} -> "
                      f"{part.sha256[:12]}): validate it again")
    return part, ""


def previous_champion(model: str) -> str | None:
    """The version a revert of `model` goes back to (the champion before the current one)."""
    from pipelines.promotion import aliases

    stack = aliases._champion_stack(aliases.history(model))
    return stack[-2] if len(stack) >= 2 else None


def monitor_model(model: str, slot: str | None, part, day: str, policy: GatePolicy, live, actor: str,
                  scorer: _Scorer) -> dict:
    from pipelines.promotion import aliases
    from pipelines.promotion.lock import registry_lock
    from pipelines.registry import mlflow_io

    out: dict = {"model": model, "slot": slot, "day": day, "champion": None, "canary": None, "windows": {},
                 "skipped": {}, "reference": None, "canary_decision": None, "revert_decision": None,
                 "revert": None, "moves": []}
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
        past = load_windows(model)
        scored = [("champion", champion, "")] + ([("canary", canary, out["champion"])]
                                                 if canary and out["canary"] != out["champion"] else [])
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
    out["revert_decision"] = asdict(rev)
    if rev.action == "revert":
        target = previous_champion(model)
        if target is None:
            raise PipelineError(f"{model}: revert due ({rev.reason}) but there is no earlier champion to revert to")
        out["revert"] = {"model": model, "to_version": target, "reason": f"auto-revert by the monitor: {rev.reason}"}
    if canary is None or out["canary"] == out["champion"]:
        return out
    can = canary_decision(windows, policy, canary_version=out["canary"], champion_version=out["champion"])
    if rev.action == "revert" and can.action != "withdraw":
        can = Decision("wait", f"held: champion v{out['champion']} is being reverted ({can.action}: {can.reason})")
    out["canary_decision"] = asdict(can)
    op = f"monitor/{model}/{day}/{can.action}-canary/v{out['canary']}"
    if can.action == "promote":
        out["moves"].append(aliases.promote_canary(model, reason=f"monitor: {can.reason}", actor=actor, op_id=op))
    elif can.action == "withdraw":
        out["moves"].append(aliases.withdraw_canary(model, reason=f"monitor: {can.reason}", actor=actor, op_id=op))
    return out


def monitor_day(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, day: str, *, live=None,
                actor: str = ACTOR, apply_reverts: bool = False) -> dict:
    """Score, record and decide for every monitored model on the labelled partition of `day`.

    Returns a JSON-safe dict: per model its windows, skips, decisions and moves; `reverts` (the
    [{model, to_version, reason}] due, for the revert operator); `errors` (models that could not be
    monitored: the others still are). `apply_reverts`: make the reverts here (CLI, no Airflow).
    """
    from mlflow.exceptions import MlflowException

    from pipelines.data.lake import Lake
    from pipelines.promotion import aliases

    if policy.revert_metric == "ctr" and live is None:
        raise ConfigError("gate.revert_metric is 'ctr' (the live CTR of a version) but no live-metrics source is "
                          "configured (gate.live_metrics_url is empty); labelled partitions cannot measure it. "
                          "Set gate.live_metrics_url or use revert_metric: auc")
    result: dict = {"day": day, "lake": lake_uri, "partition": None, "skipped": None, "models": [], "reverts": [],
                    "applied_reverts": [], "errors": []}
    part, why = usable_partition(Lake(lake_uri), day)
    if part is None:
        result["skipped"] = why
        log.warning("monitor dt=%s: nothing scored: %s", day, why)
        return result
    result["partition"] = {"sha256": part.sha256, "rows": int(len(part.frame))}
    scorer = _Scorer()
    for model, slot in monitored_models(cfg):
        try:
            out = monitor_model(model, slot, part, day, policy, live, actor, scorer)
        except (PipelineError, MlflowException) as exc:   # one broken model must not blind the others
            log.error("monitor dt=%s: %s could not be monitored: %s", day, model, exc)
            result["errors"].append({"model": model, "error": f"{type(exc).__name__}: {exc}"})
            continue
        result["models"].append(out)
        if out["revert"]:
            result["reverts"].append(out["revert"])
    if apply_reverts:
        for r in result["reverts"]:
            try:
                move = aliases.revert(r["model"], reason=r["reason"], to_version=r["to_version"], actor=actor,
                                      op_id=f"monitor/{r['model']}/{day}/revert-to/v{r['to_version']}")
                result["applied_reverts"].append(move)
            except PipelineError as exc:
                result["errors"].append({"model": r["model"], "error": f"revert refused: {exc}"})
    log.info("champion monitor dt=%s (%d rows of %s):\n%s", day, len(part.frame), lake_uri, format_table(result))
    return result


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def format_table(result: dict) -> str:
    """One line per model: versions, window AUCs, both decisions and why."""
    head = ["model", "champion", "canary", "rows", "champ AUC", "canary AUC", "canary", "revert", "why"]
    lines = [head]
    for m in result["models"]:
        ch, ca = m["windows"].get("champion") or {}, m["windows"].get("canary") or {}
        cd, rd = m["canary_decision"] or {}, m["revert_decision"] or {}
        why = "; ".join(filter(None, [*(f"{k}: {v}" for k, v in m["skipped"].items()), cd.get("reason"),
                                      rd.get("reason")]))
        lines.append([m["model"], _fmt(m["champion"]), _fmt(m["canary"]), _fmt(ch.get("rows")), _fmt(ch.get("auc")),
                      _fmt(ca.get("auc")), cd.get("action", "-"), rd.get("action", "-"), why])
    lines += [[e["model"], "-", "-", "-", "-", "-", "error", "-", e["error"]] for e in result["errors"]]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(len(widths))) + "  " + r[-1] for r in lines)
