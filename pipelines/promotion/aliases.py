"""Alias moves (promote / revert) with a durable history that lives in the tracking store.

Every move of an alias is recorded as a run in the `ctr-alias-history` experiment (tags: model, alias,
kind, from_version, to_version, reason, actor, seq). Runs are durable, readable with the MLflow
client and UI, and never overwritten, so concurrent writers cannot lose each other's entries (unlike
a single JSON tag that each writer rewrites).
"""
from __future__ import annotations

import datetime as dt
import time

from pipelines.errors import PromotionError
from pipelines.registry import mlflow_io

HISTORY_EXPERIMENT = "ctr-alias-history"
KINDS = ("promote", "revert", "override")


def _tag(v) -> str:
    return "" if v is None else str(v)


def record_move(model: str, alias: str, from_version, to_version, kind: str, reason: str, actor: str) -> dict:
    exp_id = mlflow_io.ensure_experiment(HISTORY_EXPERIMENT)
    entry = {"model": model, "alias": alias, "kind": kind, "from_version": _tag(from_version),
             "to_version": _tag(to_version), "reason": reason, "actor": actor,
             "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"), "seq": str(time.time_ns())}
    c = mlflow_io.client()
    run = c.create_run(exp_id, run_name=f"{model}@{alias}: {kind} {entry['from_version'] or '-'} -> {to_version}",
                       tags=entry)
    c.set_terminated(run.info.run_id)
    return entry


def history(model: str, alias: str = "champion") -> list[dict]:
    """Every recorded move of model@alias, oldest first."""
    import mlflow

    if mlflow.get_experiment_by_name(HISTORY_EXPERIMENT) is None:
        return []
    runs = mlflow.search_runs(experiment_names=[HISTORY_EXPERIMENT], output_format="list",
                              filter_string=f"tags.model = '{model}' and tags.alias = '{alias}'")
    keys = ("model", "alias", "kind", "from_version", "to_version", "reason", "actor", "at", "seq")
    entries = [{k: r.data.tags.get(k) for k in keys} for r in runs]
    return sorted(entries, key=lambda e: int(e["seq"]))


def current(model: str, alias: str = "champion") -> str | None:
    mv = mlflow_io.version_by_alias(model, alias)
    return str(mv.version) if mv else None


def move_alias(model: str, alias: str, version, *, kind: str, reason: str, actor: str) -> dict:
    """Point model@alias at `version` and record the move. Idempotent: no-op if already there."""
    if kind not in KINDS:
        raise PromotionError(f"unknown move kind {kind!r}; expected one of {KINDS}")
    if not reason or not reason.strip():
        raise PromotionError(f"a reason is required to move {model}@{alias}")
    version = str(version)
    mlflow_io.get_version(model, version)  # raises RegistryError if it does not exist
    before = current(model, alias)
    if before == version:
        return {"moved": False, "model": model, "alias": alias, "from_version": before, "to_version": version}
    mlflow_io.client().set_registered_model_alias(model, alias, version)
    entry = record_move(model, alias, before, version, kind, reason, actor)
    return {"moved": True, **entry}


def _champion_stack(entries: list[dict]) -> list[str]:
    """Champions in order of succession; a revert pops back to its target."""
    stack: list[str] = []
    for e in entries:
        to = e["to_version"]
        if e["kind"] == "revert" and to in stack:
            del stack[stack.index(to) + 1:]
        else:
            stack.append(to)
    return stack


def check_promotable(model: str, version: str) -> None:
    """Refuse versions that never passed a gate or whose base differs from the serving base."""
    mv = mlflow_io.get_version(model, version)
    if mv.tags.get("gate.passed") != "true":
        raise PromotionError(f"{model} v{version} never passed its gate (gate.passed="
                             f"{mv.tags.get('gate.passed', 'missing')}); refusing to make it champion")
    fp = mv.tags.get("base.fingerprint")
    if fp:
        base = mlflow_io.version_by_alias(mv.tags.get("base.name", "ctr_base"), "champion")
        serving = base.tags.get("fingerprint") if base else None
        if serving != fp:
            raise PromotionError(f"{model} v{version} was trained on base fingerprint {fp[:12]}..., but the serving "
                                 f"base is {(serving or 'missing')[:12]}...; refusing an incompatible version")


def promote(model: str, version, reason: str, actor: str = "cli") -> dict:
    version = str(version)
    check_promotable(model, version)
    return move_alias(model, "champion", version, kind="promote", reason=reason, actor=actor)


def revert(model: str, reason: str, to_version=None, actor: str = "cli") -> dict:
    """Put the previous champion (or `to_version`) back as @champion in one step."""
    now = current(model)
    if now is None:
        raise PromotionError(f"{model} has no @champion to revert")
    if to_version is None:
        stack = _champion_stack(history(model))
        if len(stack) < 2:
            raise PromotionError(f"{model} has no earlier champion to revert to (history: {stack}); name a version")
        to_version = stack[-2]
    to_version = str(to_version)
    if to_version == now:
        return {"moved": False, "model": model, "alias": "champion", "from_version": now, "to_version": now}
    check_promotable(model, to_version)
    return move_alias(model, "champion", to_version, kind="revert", reason=reason, actor=actor)
