"""The backtest's `served` comparator: the pipeline itself, replayed day by day (issue 14).

A fresh lake (a directory) and a fresh MLflow registry (SQLite, in the replay's work directory: never
the registry the environment points at) hold the replay. Before the first scored day, the history
days land in the lake and are validated, and the base stage trains, registers and gates the base at
the cutoff (`flows.base.run`). Then every scored day, in order:

* morning: `AdapterServer` (the serving code) refreshes its routes from the registry and scores the
  day's rows: a slot's `@champion`, its `@canary` for the policy's `canary_share` of users, the base
  where a slot has no adapter. Those scores are `served`.
* evening: the day lands in the lake and is validated (`flows.windows.validate_first`); the champion
  monitor scores `@champion`/`@canary` on it, promotes or withdraws canaries and makes the reverts
  due (`monitor.monitor_day(apply_reverts=True)`); then each slot's retrain trains, evaluates,
  registers, gates and releases a candidate (`flows.retrain.run`). With `lora.judged_on: next_day`
  the retrain first judges the slot's waiting candidates on the day's rows and releases the ready one,
  then trains the day's candidate on its whole window, which waits (`flows.retrain.judge_then_train`);
  a day's `gate` entry then also lists each waiting candidate's verdict (`judged`) and what it trained.

A day that fails validation stays out of the lake's validated days: nothing trains or is monitored
on it (the stages refuse it), which is what the DAGs do. Every decision is recorded per day.

Gate trust: a candidate gated on day D is scored on the next scored day's rows of its slot next to the
champion it was gated against; `trust` reports the share of released candidates that were worse than
it by more than the gate's `auc_tolerance`, and of rejected ones that were better by more than it.

The trivial policies, from the same replay: `always_release` serves each slot's newest candidate from the
morning after it was trained, whatever its gate said; `never_release` keeps each slot's first champion for
good. Each morning both are scored on the day's rows next to `served` (a slot with no such version yet is
served as `served` serves it), so the gate is measured against doing nothing and against gating nothing on
the same rows. `gate_precision`: of the releases judged the next day, the share that beat the champion they
were gated against there, with a Wilson 95% interval.

Fault injection (`faults`: {day: a fault of `bench.faults`}): that day lands with the fault (the served AUC
is still measured on the true rows); the result says what stopped each: validation, the gate, a revert, or
nothing (`backtest_verdicts.fault_outcome`; `trust`, `gate_precision` and the counts are there too).
`flip_labels` DAY is `faults={DAY: "flip_labels"}`. `repair_faults`: after its evening, a faulty day's true
rows land over it (an operator's fix), so each fault meets a clean lake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from pipelines.bench.backtest_models import Comparator
from pipelines.bench.backtest_protocol import Backtest, Day
from pipelines.bench.backtest_verdicts import counts, fault_outcome, gate_precision, rejected_checks, trust
from pipelines.bench.faults import inject
from pipelines.config import GatePolicy, PipelineConfig
from pipelines.data import commit
from pipelines.data.lake import Lake
from pipelines.errors import DataValidationError, PipelineError
from pipelines.flows import base as base_flow
from pipelines.flows import retrain, windows
from pipelines.metrics import auc
from pipelines.promotion import monitor
from pipelines.promotion.monitor import Scorer
from pipelines.registry import mlflow_io
from pipelines.registry.mlflow_scope import temporary_mlflow
from pipelines.serving.router import AdapterServer

log = logging.getLogger(__name__)

# the caller's alias lock and active experiment, unset for the replay (its URIs and artifact root are its own)
_CALLERS_ENV = ("CTR_REGISTRY_LOCK_URL", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")


@contextlib.contextmanager
def replay_registry(workdir: Path):
    """MLflow (tracking, registry, artifacts, the alias lock) on `workdir`'s own SQLite store for the
    duration; the environment and MLflow's URIs are put back afterwards."""
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    env = {**dict.fromkeys(_CALLERS_ENV), "CTR_MLFLOW_ARTIFACT_ROOT": str(workdir / "artifacts")}
    with temporary_mlflow(uri, env=env):
        yield uri


class Served(Comparator):
    """What the pipeline served each morning after its gates, canaries and reverts; `cpu_s` is the
    process CPU seconds of the evening stages (validate, monitor, train, evaluate, register, gate)."""

    name = "served"

    def __init__(
        self,
        cfg: PipelineConfig,
        policy: GatePolicy,
        workdir: str | os.PathLike | None = None,
        *,
        flip_labels: str | None = None,
        faults: dict[str, str] | None = None,
        repair_faults: bool = False,
    ) -> None:
        super().__init__()
        self.cfg, self.policy, self.repair_faults = cfg, policy, repair_faults
        self.faults = {**({flip_labels: "flip_labels"} if flip_labels else {}), **(faults or {})}
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ctr-backtest-served-")).resolve()
        self.lake_uri = str(self.workdir / "lake")
        self.server = None
        self.scorer = None  # the pyfuncs `_judge` loaded
        self.days: list[dict] = []
        self.pending: list[dict] = []  # yesterday's gate decisions, judged on today's rows
        self.judged: list[dict] = []
        self.base: dict | None = None
        self.newest: dict[str, str] = {}  # slot -> its newest candidate (always_release serves it)
        self.first_champion: dict[str, str] = {}  # slot -> its first champion (never_release keeps it)
        self.policies: dict[str, list[np.ndarray]] = {"always_release": [], "never_release": []}

    # ------------------------------------------------------------------ the comparator
    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        with replay_registry(self.workdir):
            if self.base is None:
                self._start(bt, day)
            rows = bt.scored(day)
            routes = self.server.refresh()["routes"]
            scores, keys = self.server.score(rows, return_versions=True)
            record = {
                "date": day.date,
                "routes": routes,
                "scored_by": _counts(keys),
                "slots": per_slot(rows, scores, routes, self.cfg),
            }
            self.judged += [self._judge(p, rows) for p in self.pending]
            for policy, versions in (("always_release", self.newest), ("never_release", self.first_champion)):
                self.policies[policy].append(self._score_policy(rows, np.asarray(scores, dtype=np.float64), versions))
            record.update(self._timed(self._evening, bt, day))
            if day.date in self.faults and self.repair_faults:
                self._repair(bt, day)
            self.days.append(record)
        return np.asarray(scores, dtype=np.float64)

    def __getstate__(self) -> dict:
        # Sent back from the backtest's second process: the server and the scorer (threads, locks, the
        # loaded models) stay there; the decisions are in `days`.
        return {**self.__dict__, "server": None, "scorer": None}

    def policy_scores(self) -> dict[str, np.ndarray]:
        """{always_release, never_release: every scored row's score under that policy, in row order}."""
        return {k: np.concatenate(v) for k, v in self.policies.items() if v}

    def info(self) -> dict:
        outcomes = {
            day: {"fault": name, **fault_outcome(self.days, day, self.policy.revert_windows)}
            for day, name in self.faults.items()
        }
        return {
            "workdir": str(self.workdir),
            "base": self.base,
            **counts(self.days),
            "trust": trust(self.judged, self.policy.auc_tolerance),
            "gate_precision": gate_precision(self.judged),
            "fault": next(iter(outcomes.values()), None),
            "faults": outcomes,
            "days": self.days,
        }

    # ------------------------------------------------------------------ the stages
    def _start(self, bt: Backtest, first: Day) -> None:
        """Land and validate the history days, then the base stage at the cutoff (the day before)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        history = bt.frame.iloc[: first.start]
        cutoff = (pd.Timestamp(first.date) - pd.Timedelta(days=1)).strftime("%Y-%m-%d")
        history = history[bt.dates[: first.start] <= cutoff]
        t = time.perf_counter()
        for date, part in history.groupby(bt.dates[: len(history)], sort=True):
            self._land(date, part)
        windows.validate_first(self.cfg, self.lake_uri, cutoff, windows.base_days(self.cfg, cutoff))
        released = self._timed(base_flow.run, self.cfg, self.lake_uri, cutoff, actor="backtest", policy=self.policy)
        self.base = {
            "cutoff": cutoff,
            "version": released["version"],
            "passed": released["passed"],
            "moved": released["moved"],
            "seconds": round(time.perf_counter() - t, 1),
        }
        if not released["moved"]:
            raise PipelineError(
                f"backtest served: the base trained on data up to {cutoff} did not pass its gate "
                f"({released['model']} v{released['version']}); nothing would serve"
            )
        self.server = AdapterServer.from_config(self.cfg, canary_share=self.policy.canary_share, new_users=None)
        log.info(
            "backtest served: base v%s released in %.0f s (lake %s)",
            released["version"],
            self.base["seconds"],
            self.lake_uri,
        )

    def _land(self, date: str, frame: pd.DataFrame) -> None:
        commit.write_frames(Lake(self.lake_uri), date, [frame.reset_index(drop=True)], overwrite=True)

    def _evening(self, bt: Backtest, day: Day) -> dict:
        """The day's partition lands; validate, monitor, retrain every slot. Returns what was decided."""
        part = _day_rows(bt, day.date)
        if day.date in self.faults:
            part = self._inject(bt, day, part)
        self._land(day.date, part)
        self.pending = []  # judged this morning; tonight's candidates are judged tomorrow
        out: dict = {"validated": True, "monitor": {}, "gate": {}}
        try:
            windows.validate_first(self.cfg, self.lake_uri, day.date, 1)
        except DataValidationError as exc:
            log.warning("backtest served dt=%s: validation failed, nothing trains on it: %s", day.date, exc)
            return {
                **out,
                "validated": False,
                "validation_error": str(exc)[:500],
                "failed_checks": [f["check"].partition(" @ ")[0] for f in exc.failures],
            }
        watched = monitor.monitor_day(
            self.cfg, self.policy, self.lake_uri, day.date, actor="backtest", apply_reverts=True
        )
        out["monitor"] = _monitor_summary(watched)
        for slot in self.cfg.data.slots:
            model = self.cfg.adapter_model_name(slot)
            champion = mlflow_io.version_by_alias(model, "champion")
            try:
                result = retrain.run(self.cfg, self.policy, self.lake_uri, day.date, slot, actor="backtest")
            except PipelineError as exc:  # e.g. too few rows in the window: the slot keeps what it serves
                out["gate"][slot] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            against = str(champion.version) if champion else None
            if "judged_on" in result:  # lora.judged_on next_day: judged the waiting ones, trained, released
                gate = _judged_summary(result)
                decided = [
                    {"version": j["version"], "against": j["against"], "passed": False, "released": False}
                    for j in result["judged"]["judged"]
                    if j["verdict"] == "reject" and not j.get("serving")
                ]
                if result.get("decision"):
                    d = result["decision"]
                    decided.append(
                        {
                            "version": str(d["version"]),
                            "against": d.get("champion_version"),
                            "passed": bool(d["passed"]),
                            "released": _released(result, d["version"]),
                        }
                    )
            else:
                gate = _gate_summary(result)
                decided = [
                    {
                        "version": gate["version"],
                        "against": against,
                        "passed": gate["passed"],
                        "released": gate["released"],
                    }
                ]
            out["gate"][slot] = gate
            self.newest[slot] = gate.get("trained", gate.get("version"))
            first = mlflow_io.version_by_alias(model, "champion")
            if first is not None:
                self.first_champion.setdefault(slot, str(first.version))
            self.pending += [{"day": day.date, "slot": slot, "model": model, **d} for d in decided]
        return out

    def _repair(self, bt: Backtest, day: Day) -> None:
        """The faulty day's true rows land over it and are validated, as an operator fixes a quarantined
        partition: the next fault meets the pipeline as it would alone (what was released stays released)."""
        self._land(day.date, _day_rows(bt, day.date))
        try:
            windows.validate_first(self.cfg, self.lake_uri, day.date, 1)
        except DataValidationError as exc:
            log.warning("backtest served dt=%s: the repaired day does not validate either: %s", day.date, exc)

    def _inject(self, bt: Backtest, day: Day, part: pd.DataFrame) -> pd.DataFrame:
        """The day's rows with its fault; the day before's rows (in the log) are what a replay re-sends."""
        before = bt.dates[bt.dates < day.date]
        previous = _day_rows(bt, before.max() if len(before) else "")
        log.warning("backtest served dt=%s: injecting the fault %s", day.date, self.faults[day.date])
        return inject(self.faults[day.date], part, previous)

    def _score_policy(self, rows: pd.DataFrame, served: np.ndarray, versions: dict[str, str]) -> np.ndarray:
        """`served`, with each slot that has a version in `versions` scored by it instead."""
        self.scorer = self.scorer or Scorer()
        out = served.copy()
        for slot, version in versions.items():
            at = (rows["slot"] == slot).to_numpy()
            if at.any():
                out[at] = self.scorer.predict(self.cfg.adapter_model_name(slot), version, rows[at])
        return out

    def _judge(self, pending: dict, rows: pd.DataFrame) -> dict:
        """A candidate gated yesterday and the champion it was gated against, scored on today's rows of
        its slot (None where there was no champion or the slot has no rows with both classes)."""
        self.scorer = self.scorer or Scorer()  # a slot's champion is judged against for many days: load it once
        out = {**pending, "candidate_auc": None, "against_auc": None}
        part = rows[rows["slot"] == pending["slot"]]
        y = part["label"].to_numpy(dtype="float64")
        if pending["against"] is None or len(set(y)) < 2:
            return out
        for key, version in (("candidate_auc", pending["version"]), ("against_auc", pending["against"])):
            out[key] = round(float(auc(y, self.scorer.predict(pending["model"], version, part))), 4)
        return out


# ---------------------------------------------------------------------------------- pure summaries
def _day_rows(bt: Backtest, date: str) -> pd.DataFrame:
    """Every row of the log's UTC day `date` (the first scored day's early rows included): what lands."""
    return bt.frame.iloc[(bt.dates == date).nonzero()[0]]


def _counts(keys) -> dict[str, int]:
    values, n = np.unique(np.asarray(keys, dtype=str), return_counts=True)
    return {str(v): int(c) for v, c in zip(values, n)}


def per_slot(rows: pd.DataFrame, scores, routes: dict, cfg: PipelineConfig) -> dict:
    """Per slot with rows: its rows, the AUC of what served them, and the champion / canary serving it."""
    out = {}
    for slot in sorted(set(rows["slot"])):
        at = (rows["slot"] == slot).to_numpy()
        y = rows["label"].to_numpy()[at]
        model = cfg.adapter_model_name(slot)
        out[slot] = {
            "rows": int(at.sum()),
            "auc": round(float(auc(y, np.asarray(scores)[at])), 4) if len(set(y)) == 2 else None,
            **{a: (routes.get(f"{model}@{a}") or "").rpartition(":")[2] or None for a in ("champion", "canary")},
        }
    return out


def _gate_summary(decision: dict) -> dict:
    release = decision.get("release") or {}
    failed = [c.get("name") for c in decision.get("checks", []) if not c.get("passed", True)]
    cos = next((c.get("value") for c in decision.get("checks", []) if c.get("name") == "interference"), None)
    return {
        "version": str(decision.get("version")),
        "passed": bool(decision["passed"]),
        "released": bool(release.get("moved")),
        "held": bool(release.get("held")),
        "alias": release.get("alias"),
        "failed_checks": failed,
        "interference": cos,
    }


def _released(result: dict, version: str) -> bool:
    d = result.get("decision") or {}
    return str(d.get("version")) == str(version) and bool((d.get("release") or {}).get("moved"))


def _judged_summary(result: dict) -> dict:
    """A prequential evening of a slot (flows.retrain.judge_then_train): the candidate it trained (`trained`),
    each waiting one's verdict (`judged`), and, as `_gate_summary`, the decision it made: the release, else
    the newest rejection (`rejections` counts them all), else none (every waiting one waits on)."""
    judged = [
        {
            k: j.get(k)
            for k in (
                "version",
                "verdict",
                "n",
                "lower",
                "upper",
                "candidate_auc",
                "champion_auc",
                "against",
                "failed",
                "reason",
                "serving",
            )
        }
        for j in result["judged"]["judged"]
    ]
    out = {
        "trained": str(result["version"]),
        "judged": judged,
        "rejections": sum(j["verdict"] == "reject" for j in judged),
    }
    if result.get("decision"):
        return {**out, **_gate_summary(result["decision"])}
    rejected = [j for j in judged if j["verdict"] == "reject"]
    if rejected:
        return {
            **out,
            "version": rejected[-1]["version"],
            "passed": False,
            "released": False,
            "held": False,
            "alias": None,
            "failed_checks": rejected_checks(rejected[-1]),
            "interference": None,
        }
    return out


def _monitor_summary(result: dict) -> dict:
    moves = [
        {"model": m.get("model"), "kind": m.get("kind"), "to_version": m.get("to_version")}
        for entry in result["models"]
        for m in entry["moves"]
        if m.get("moved")
    ]
    reverts = [
        {"model": r.get("model"), "to_version": r.get("to_version"), "reason": r.get("reason")}
        for r in result["applied_reverts"]
        if r.get("moved")
    ]
    return {"moves": moves, "reverts": reverts, "errors": result["errors"]}
