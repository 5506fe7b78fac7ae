"""The alias history: every move of an alias, as a run in the tracking store.

Every move is recorded as a run in the `ctr-alias-history` experiment (tags: model, alias, kind,
from_version, to_version, reason, actor, seq, op_id, status). Runs are durable, readable with the
MLflow client and UI, and never deleted, so concurrent writers cannot lose each other's entries (unlike
a single JSON tag that each writer rewrites). Storage only: the moves themselves (and the lock they
take) are `promotion.aliases`.

A move and its record cannot be one write (the alias is in the registry, the record a run), so the
record is written ahead: an entry is written `pending` before the alias moves and marked `done`
after. A process that dies in between leaves a pending entry, which the next move (or a retry) of
the model settles from the registry (`outcome`): the alias at the entry's target means the move
happened (`done`), at its origin that it did not (`rolled_back`). `history` is the done entries
only: one unbroken chain per alias, which reverts are computed from.
"""

from __future__ import annotations

import datetime as dt
import time

import mlflow

from pipelines.registry import mlflow_io

HISTORY_EXPERIMENT = "ctr-alias-history"
KINDS = ("promote", "revert", "override", "canary", "withdraw")
ENTRY_KEYS = ("model", "alias", "kind", "from_version", "to_version", "reason", "actor", "at", "seq", "op_id", "status")
PENDING, DONE, ROLLED_BACK = "pending", "done", "rolled_back"
# Entries written before write-ahead records have no status: they were written after their move.
_DONE = (DONE, "")


def _tag(v) -> str:
    return "" if v is None else str(v)


def record_intent(
    model: str,
    alias: str,
    from_version,
    to_version,
    kind: str,
    reason: str,
    actor: str,
    op_id: str | None = None,
    after_seq: int = 0,
) -> dict:
    """Append one `pending` entry, before the alias moves (`mark` it done after). `after_seq`: the last
    recorded seq (the new one is larger even when the clocks of two writers disagree; callers hold the
    model's registry lock). Returns the entry with its `run_id`."""
    exp_id = mlflow_io.ensure_experiment(HISTORY_EXPERIMENT)
    entry = {
        "model": model,
        "alias": alias,
        "kind": kind,
        "from_version": _tag(from_version),
        "to_version": _tag(to_version),
        "reason": reason,
        "actor": actor,
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
        "seq": str(max(time.time_ns(), after_seq + 1)),
        "op_id": op_id or "",
        "status": PENDING,
    }
    c = mlflow_io.client()
    run = c.create_run(
        exp_id, run_name=f"{model}@{alias}: {kind} {entry['from_version'] or '-'} -> {to_version}", tags=entry
    )
    c.set_terminated(run.info.run_id)
    return {**entry, "run_id": run.info.run_id}


def mark(entry: dict, status: str) -> dict:
    """Settle a pending entry as `done` or `rolled_back` (one tag write on its run)."""
    if status not in (DONE, ROLLED_BACK):
        raise ValueError(f"an entry settles as {DONE} or {ROLLED_BACK}, not {status!r}")
    mlflow_io.client().set_tag(entry["run_id"], "status", status)
    return {**entry, "status": status}


def outcome(entry: dict, alias_now: str | None) -> str | None:
    """What became of a pending entry, given where its alias points now: `done` (at its target),
    `rolled_back` (still at its origin), None (elsewhere: moved outside the registry lock). Pure."""
    now = _tag(alias_now)
    if now == entry["to_version"]:
        return DONE
    if now == entry["from_version"]:
        return ROLLED_BACK
    return None


def entries(model: str, alias: str | None = None) -> list[dict]:
    """Every entry of model@alias (every alias with alias=None) whatever its status, oldest first."""
    if mlflow.get_experiment_by_name(HISTORY_EXPERIMENT) is None:
        return []
    where = f"tags.model = '{model}'" + (f" and tags.alias = '{alias}'" if alias else "")
    runs = mlflow.search_runs(
        experiment_names=[HISTORY_EXPERIMENT], output_format="list", filter_string=where, max_results=50000
    )
    found = [{**{k: r.data.tags.get(k, "") for k in ENTRY_KEYS}, "run_id": r.info.run_id} for r in runs]
    return sorted(found, key=lambda e: int(e["seq"]))


def done(found: list[dict]) -> list[dict]:
    """The moves that happened, of `entries(...)`: the history proper."""
    return [e for e in found if e["status"] in _DONE]


def history(model: str, alias: str | None = "champion") -> list[dict]:
    """Every move of model@alias that happened (every alias with alias=None), oldest first."""
    return done(entries(model, alias))


def pending(model: str) -> list[dict]:
    """Entries of `model` written ahead of a move whose outcome is not settled yet."""
    return [e for e in entries(model) if e["status"] == PENDING]


def current(model: str, alias: str = "champion") -> str | None:
    mv = mlflow_io.version_by_alias(model, alias)
    return str(mv.version) if mv else None
