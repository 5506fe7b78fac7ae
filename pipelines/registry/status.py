"""What is registered and serving: per model, every version's evaluation and gate result, the
current aliases, and the champion history. Used by `python -m pipelines status` and the demo."""

from __future__ import annotations

import json

from pipelines.config import PipelineConfig
from pipelines.registry import history, mlflow_io
from pipelines.registry.integrity import FINGERPRINT_TAG


def model_status(name: str) -> dict:
    c = mlflow_io.client()
    rm = c.get_registered_model(name)
    versions = []
    for mv in sorted(c.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        t = mv.tags
        cand = json.loads(t["eval.candidate"]) if t.get("eval.candidate") else {}
        champ = json.loads(t["eval.champion"]) if t.get("eval.champion") not in (None, "", "null") else None
        versions.append(
            {
                "version": str(mv.version),
                "data_last": t.get("data.last"),
                "candidate_auc": cand.get("auc", _float(t.get("holdout.auc"))),
                "champion_auc": champ.get("auc") if champ else None,
                "vs_version": t.get("eval.champion_version") or None,
                "gate": {"true": "passed", "false": "rejected"}.get(t.get("gate.passed"), t.get("gate.passed")),
                "first_run": t.get("gate.first_run") == "true",
            }
        )
        if t.get("gate.kind") == "direct":
            versions[-1]["gate"] = "direct (no gate)"
        if t.get("gate.override"):
            versions[-1]["gate"] = f"{versions[-1]['gate']}, overridden"
        versions[-1]["approval"] = _approval(t)
    entries = history.entries(name)
    return {
        "model": name,
        "aliases": dict(sorted(rm.aliases.items())) if rm.aliases else {},
        "versions": versions,
        "history": [e for e in history.done(entries) if e["alias"] == "champion"],
        # written ahead of a move whose process died; the next move of the model settles it
        "pending": [e for e in entries if e["status"] == history.PENDING],
    }


def adapters_on_other_bases(base_name: str, fingerprint: str) -> list[dict]:
    """The serving adapter versions (`@champion`, `@canary` of every registered model) trained on a
    version of `base_name` whose fingerprint is not `fingerprint`: what a move of `base_name@champion`
    to that fingerprint makes incompatible (they must be retrained on it). Sorted by model and alias.
    Other base models (a version with its own `fingerprint`) are not adapters and are left out."""
    c = mlflow_io.client()
    out, token = [], None
    while True:  # every page: a registry with more models than one page holds must not hide any
        page = c.search_registered_models(max_results=200, page_token=token)
        for rm in page:
            for alias, version in sorted((rm.aliases or {}).items()):
                if alias not in ("champion", "canary"):
                    continue
                tags = c.get_model_version(rm.name, version).tags
                if FINGERPRINT_TAG in tags or tags.get("base.name", base_name) != base_name:
                    continue
                if tags.get("base.fingerprint") != fingerprint:
                    out.append(
                        {
                            "model": rm.name,
                            "alias": alias,
                            "version": str(version),
                            "base_version": tags.get("base.version"),
                            "base_fingerprint": tags.get("base.fingerprint"),
                        }
                    )
        token = page.token
        if not token:
            return sorted(out, key=lambda a: (a["model"], a["alias"]))


def _approval(tags: dict) -> str | None:
    """ "Approve by alice" / "Reject by bob" from the version's `release.approval` record (None: none)."""
    try:
        record = json.loads(tags.get("release.approval") or "null")
    except ValueError:
        return "unreadable"
    return f"{record.get('answer')} by {record.get('by')}" if isinstance(record, dict) else None


def _float(v):
    return None if v in (None, "") else float(v)


def status(cfg: PipelineConfig) -> list[dict]:
    names = (
        [cfg.registry.base_model_name]
        + [cfg.adapter_model_name(s) for s in cfg.data.slots]
        + [cfg.cold_start.model_name]
    )
    known = {m.name for m in mlflow_io.client().search_registered_models()}
    return [model_status(n) for n in names if n in known]


def format_status(models: list[dict]) -> str:
    def f(v):
        return "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

    out = []
    for m in models:
        al = ", ".join(f"@{a}=v{v}" for a, v in m["aliases"].items()) or "no aliases"
        out.append(f"{m['model']}  ({al})")
        out.append(f"  {'ver':>3}  {'data to':10}  {'cand AUC':>8}  {'champ AUC':>9}  {'vs':>3}  gate")
        for v in m["versions"]:
            gate = (
                (v["gate"] or "-")
                + (" (first run)" if v["first_run"] else "")
                + (f"; {v['approval']}" if v.get("approval") else "")
            )
            out.append(
                f"  {v['version']:>3}  {f(v['data_last']):10}  {f(v['candidate_auc']):>8}  "
                f"{f(v['champion_auc']):>9}  {f(v['vs_version']):>3}  {gate}"
            )
        for h in m["history"]:
            out.append(
                f"  history: {h['at']}  {h['kind']:8} v{h['from_version'] or '-'} -> v{h['to_version']}  "
                f"by {h['actor']}: {h['reason']}"
            )
        for h in m.get("pending", []):
            out.append(
                f"  PENDING: {h['at']}  {h['kind']:8} @{h['alias']} v{h['from_version'] or '-'} -> "
                f"v{h['to_version'] or '-'} (op {h['op_id'] or '-'}): settled by the next move"
            )
    return "\n".join(out)
