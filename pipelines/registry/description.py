"""What serves and why, on the registered model's page: its description, rewritten at every alias move.

The MLflow UI shows a registered model's description on its page; the aliases alone say where
@champion points, not why. So every alias move (`promotion.aliases.move_alias`), registration and
rejection rewrites one block of the description: each alias, its version, since when, by which move
and its reason (the gate's verdict, the monitor's windows, an operator's words), and the versions lately
rejected or held. Text a person wrote outside the block is kept. `render` is pure; `publish` reads the
registry and the alias history and writes.
"""

from __future__ import annotations

import datetime as dt
import json

from pipelines.registry import mlflow_io
from pipelines.registry.history import history
from pipelines.registry.lock import registry_lock

BEGIN, END = "<!-- ctr-lora-ops: what serves -->", "<!-- /ctr-lora-ops: what serves -->"
REJECTED_TAG = "rejected"  # on a version: who rejected it and why (filter: tags.rejected != '')
HELD_TAG = "release.held"
ALIAS_ORDER = ("champion", "canary", "candidate")
LISTED = 5  # rejected / held versions listed, newest first


def _cell(text) -> str:
    return str(text or "-").replace("|", "\\|").replace("\n", " ")


def _gate(tags: dict) -> str:
    passed = tags.get("gate.passed")
    if passed is None:
        return "not gated"
    if passed == "pending":
        return "waiting for its gate"
    checks = json.loads(tags.get("gate.checks") or "[]")
    failed = [c["name"] for c in checks if not c.get("passed")]
    verdict = "passed" if passed == "true" else "failed"
    return f"gate {verdict}" + (f" ({', '.join(failed)} failed)" if failed else f" ({len(checks)} checks)")


def render(
    model: str, aliases: dict[str, dict], rejected: list[tuple[str, str]], held: list[tuple[str, str]], now: str
) -> str:
    """The block. `aliases`: alias -> {"version", "tags", and the latest recorded move into it: "at", "kind",
    "actor", "reason"; for @candidate, which registration sets, only "at": the version's creation)}; `rejected` /
    `held`: (version, why)."""
    lines = [
        BEGIN,
        f"**What serves {model}** (rewritten at every alias move; {now})",
        "",
        "| alias | version | since | move | why |",
        "|---|---|---|---|---|",
    ]
    for alias in sorted(aliases, key=lambda a: (ALIAS_ORDER.index(a) if a in ALIAS_ORDER else 9, a)):
        a = aliases[alias]
        version = f"v{a['version']}"
        if alias == "canary" and a["tags"].get("canary.share"):
            version += f" ({float(a['tags']['canary.share']):.0%} of users)"
        move = f"{a['kind']} by {a['actor']}" if a.get("kind") else "registered"
        why = a.get("reason") or ""
        lines.append(
            f"| @{alias} | {version} | {_cell(a.get('at'))} | {_cell(move)} | "
            f"{_cell('; '.join(x for x in (why, _gate(a['tags'])) if x))} |"
        )
    if not aliases:
        lines.append("| - | nothing serves yet | - | - | - |")
    for title, found in (("Rejected", rejected), ("Held", held)):
        if found:
            lines += ["", f"{title}: " + "; ".join(f"v{v} ({_cell(why)})" for v, why in found[:LISTED])]
    lines += ["", "Every move: experiment `ctr-alias-history`; every verdict: the version's tags and model card.", END]
    return "\n".join(lines)


def merged(description: str | None, block: str) -> str:
    """`description` with its block replaced by `block` (appended when it has none); the rest kept."""
    text = description or ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return (text.rstrip() + "\n\n" + block) if text.strip() else block


def _held_why(raw: str) -> str:
    try:
        return json.loads(raw).get("reason") or raw
    except (ValueError, AttributeError):
        return raw


def _created(v) -> str | None:
    ms = getattr(v, "creation_timestamp", None)
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="seconds") if ms else None


def publish(model: str) -> str:
    """Rewrite `model`'s block from the registry and the alias history; returns the block."""
    with registry_lock(model):  # re-entrant: an alias move publishes while it holds the lock
        return _publish(model)


def _publish(model: str) -> str:
    c = mlflow_io.client()
    rm = c.get_registered_model(model)
    moves = {}
    for e in history(model, alias=None):  # oldest first: the last one into each alias wins
        moves[e["alias"]] = e
    # One search for every version's tags (the aliases come from the registered model).
    versions = sorted(c.search_model_versions(f"name = '{model}'"), key=lambda v: -int(v.version))
    tags = {str(v.version): dict(v.tags or {}) for v in versions}
    created = {str(v.version): _created(v) for v in versions}
    aliases = {}
    for alias, version in (rm.aliases or {}).items():
        move = moves.get(alias) if (moves.get(alias) or {}).get("to_version") == str(version) else None
        aliases[alias] = {
            "version": str(version),
            "tags": tags.get(str(version), {}),
            **({k: move[k] for k in ("at", "kind", "actor", "reason")} if move else {"at": created.get(str(version))}),
        }
    serving = {a["version"] for a in aliases.values()}
    rejected = [(str(v.version), v.tags[REJECTED_TAG]) for v in versions if v.tags.get(REJECTED_TAG)]
    held = [
        (str(v.version), _held_why(v.tags[HELD_TAG]))
        for v in versions
        if v.tags.get(HELD_TAG) and str(v.version) not in serving
    ]
    block = render(model, aliases, rejected, held, dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    c.update_registered_model(model, description=merged(rm.description, block))
    return block


def reject(model: str, version: str, why: str) -> None:
    """Mark `version` rejected (tag `rejected`: why) and take @candidate off it if it holds it. Under the
    registry lock, reading where @candidate points now: a registration may have moved it to a newer version."""
    c = mlflow_io.client()
    c.set_model_version_tag(model, version, REJECTED_TAG, why[:5000])
    with registry_lock(model):
        if str((c.get_registered_model(model).aliases or {}).get("candidate")) == str(version):
            c.delete_registered_model_alias(model, "candidate")


def clear_rejection(model: str, version: str, *, gate_only: bool = True, mv=None) -> None:
    """A version that passed a new gate is no longer shown rejected by the gate (a person's rejection
    stays: it is lifted by an override only, `gate_only=False`). `mv`: as in `reject`."""
    why = (mlflow_io.get_version(model, version) if mv is None else mv).tags.get(REJECTED_TAG)
    if why and (not gate_only or why.startswith("gate:")):
        mlflow_io.client().delete_model_version_tag(model, version, REJECTED_TAG)
