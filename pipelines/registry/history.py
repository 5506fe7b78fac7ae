"""The alias history: every move of an alias, as a run in the tracking store.

Every move is recorded as a run in the `ctr-alias-history` experiment (tags: model, alias, kind,
from_version, to_version, reason, actor, seq, op_id). Runs are durable, readable with the MLflow
client and UI, and never overwritten, so concurrent writers cannot lose each other's entries (unlike
a single JSON tag that each writer rewrites). Storage only: the moves themselves (and the lock they
take) are `promotion.aliases`.
"""
from __future__ import annotations

import datetime as dt
import time

from pipelines.registry import mlflow_io

HISTORY_EXPERIMENT = "ctr-alias-history"
KINDS = ("promote", "revert", "override", "canary", "withdraw")
ENTRY_KEYS = ("model", "alias", "kind", "from_version", "to_version", "reason", "actor", "at", "seq", "op_id")


def _tag(v) -> str:
    return "" if v is None else str(v)


def record_move(model: str, alias: str, from_version, to_version, kind: str, reason: str, actor: str,
                op_id: str | None = None, after_seq: int = 0) -> dict:
    """Append one entry to the history. `after_seq`: the last recorded seq (the new one is larger even
    when the clocks of two writers disagree; callers hold the model's registry lock)."""
    exp_id = mlflow_io.ensure_experiment(HISTORY_EXPERIMENT)
    entry = {"model": model, "alias": alias, "kind": kind, "from_version": _tag(from_version),
             "to_version": _tag(to_version), "reason": reason, "actor": actor,
             "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
             "seq": str(max(time.time_ns(), after_seq + 1)), "op_id": op_id or ""}
    c = mlflow_io.client()
    run = c.create_run(exp_id, run_name=f"{model}@{alias}: {kind} {entry['from_version'] or '-'} -> {to_version}",
                       tags=entry)
    c.set_terminated(run.info.run_id)
    return entry


def history(model: str, alias: str | None = "champion") -> list[dict]:
    """Every recorded move of model@alias (every alias with alias=None), oldest first."""
    import mlflow

    if mlflow.get_experiment_by_name(HISTORY_EXPERIMENT) is None:
        return []
    where = f"tags.model = '{model}'" + (f" and tags.alias = '{alias}'" if alias else "")
    runs = mlflow.search_runs(experiment_names=[HISTORY_EXPERIMENT], output_format="list", filter_string=where,
                              max_results=50000)
    entries = [{k: r.data.tags.get(k, "") for k in ENTRY_KEYS} for r in runs]
    return sorted(entries, key=lambda e: int(e["seq"]))


def current(model: str, alias: str = "champion") -> str | None:
    mv = mlflow_io.version_by_alias(model, alias)
    return str(mv.version) if mv else None
