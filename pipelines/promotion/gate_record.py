"""The gate's record in MLflow: `run` decides (`promotion.gate`, pure) on the version's evaluation and stores
the decision on the version (tags + JSON artifact and picture on its training run), prints it as a table and
publishes the model card; `override` records a person's release of a rejected version beside the gate's own
verdict. Releasing a passing version (canary or champion) is a separate step (`promotion.release`), so a
human approval can sit between the two.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import tempfile
from pathlib import Path

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError
from pipelines.evaluation.report import plot_gate
from pipelines.promotion.eligibility import APPROVAL_REQUIRED_TAG, APPROVAL_TAG, GATE_CHAMPION_TAG, approval_of
from pipelines.promotion.gate import base_check, base_model_check, decide, decide_base, format_table
from pipelines.registry import description, mlflow_io, model_card
from pipelines.registry.integrity import FINGERPRINT_TAG

log = logging.getLogger(__name__)


def fingerprints(mv) -> dict:
    """{"candidate": the base fingerprint recorded on the ModelVersion `mv`, "serving": its base's
    @champion's (ctr_base unless the version names another); None where there is none}."""
    serving = mlflow_io.version_by_alias(mv.tags.get("base.name", "ctr_base"), "champion")
    return {
        "candidate": mv.tags.get("base.fingerprint"),
        "serving": serving.tags.get("fingerprint") if serving else None,
    }


def record(model: str, version: str, decision: dict, evaluation: dict | None, mv=None) -> None:
    """The decision on the version (tags), its training run (JSON artifact), the log and the card.
    `mv`: the version as already fetched by the caller (fetched here otherwise)."""
    c = mlflow_io.client()
    mv = mlflow_io.get_version(model, version) if mv is None else mv
    if decision.get("override"):  # the gate's own verdict stays as it was; the override sits beside it
        c.set_model_version_tag(model, version, "gate.override", json.dumps(decision["override"]))
    else:
        # An approval answers one gate decision: a new decision needs a new one (a rejection stays).
        if (approval_of(mv.tags) or {}).get("answer") == "Approve":
            c.delete_model_version_tag(model, version, APPROVAL_TAG)
        c.set_model_version_tag(model, version, "gate.passed", "true" if decision["passed"] else "false")
        c.set_model_version_tag(model, version, "gate.first_run", str(decision["first_run"]).lower())
        # What the release checks: the champion compared against (stale gate) and the approval rule then.
        c.set_model_version_tag(model, version, GATE_CHAMPION_TAG, decision.get("champion_version") or "")
        c.set_model_version_tag(
            model, version, APPROVAL_REQUIRED_TAG, str(bool((decision.get("policy") or {}).get("approval"))).lower()
        )
        c.set_model_version_tag(
            model,
            version,
            "gate.checks",
            json.dumps([{k: ch[k] for k in ("name", "value", "passed")} for ch in decision["checks"]])[:5000],
        )
    if mv.run_id:
        suffix = "_override" if decision.get("override") else ""
        c.log_dict(mv.run_id, decision, f"gate/decision_v{version}{suffix}.json")
        with tempfile.TemporaryDirectory() as tmp:  # the same record as a picture, for the MLflow UI
            c.log_artifact(mv.run_id, plot_gate(decision, Path(tmp) / f"decision_v{version}{suffix}.png"), "gate")
    log.info("%s v%s\n%s", model, version, format_table(decision))
    model_card.publish(model, version, evaluation=evaluation, decision=decision)
    _show_verdict(model, version, decision, mv)


def _show_verdict(model: str, version: str, decision: dict, mv) -> None:
    """On the registry's pages: a rejected version loses @candidate and carries tag `rejected`
    (`mv`: the version as fetched before this decision's tags)."""
    if decision["passed"]:
        description.clear_rejection(model, version, gate_only=not decision.get("override"), mv=mv)
    else:
        failed = [ch["name"] for ch in decision["checks"] if not ch.get("passed")]
        against = decision.get("champion_version")
        description.reject(
            model,
            version,
            f"gate: {', '.join(failed) or 'failed'} failed" + (f" against v{against}" if against else ""),
        )
    description.publish(model)


def run(policy: GatePolicy, model: str, version: str, evaluation: dict, actor: str = "cli") -> dict:
    """Decide and record. Releasing a passing version is `promotion.release.release`."""
    mv = mlflow_io.get_version(model, version)  # once: for its base fingerprint and its training run
    # A base model records its own fingerprint; an adapter, the base's it was trained on.
    decision = (
        decide_base(policy, evaluation)
        if mv.tags.get(FINGERPRINT_TAG)
        else decide(policy, evaluation, base=fingerprints(mv))
    )
    decision.update(model=model, version=version, decided_by=actor)
    record(model, version, decision, evaluation, mv=mv)
    return decision


def override(model: str, version: str, reason: str, actor: str) -> dict:
    """Record a human override of a gate rejection. It can never skip base compatibility: an adapter
    trained on another base computes garbage on the serving one, whatever a person decides."""
    if not isinstance(reason, str) or len(reason.strip()) < 5:
        raise PromotionError(f"an override of {model} v{version} needs a reason (at least 5 characters)")
    mv = mlflow_io.get_version(model, version)
    # A base model records its own fingerprint: there is no base under it to be compatible with.
    base = base_model_check() if mv.tags.get(FINGERPRINT_TAG) else base_check(fingerprints(mv))
    if not base["passed"]:
        raise PromotionError(
            f"override of {model} v{version} refused: base fingerprint {base['value']}... is not "
            f"the serving base's {base['threshold'] or 'missing'}...; no override skips this check"
        )
    checks = json.loads(mv.tags.get("gate.checks") or "[]")
    approval = approval_of(mv.tags)
    decision = {
        "passed": True,
        "first_run": mv.tags.get("gate.first_run") == "true",
        "champion_version": None,
        "model": model,
        "version": version,
        "checks": [base]
        + [
            {**c, "threshold": None, "reason": "original gate result (overridden)"}
            for c in checks
            if c.get("name") != "base_compatible"
        ],
        "override": {
            "actor": actor,
            "reason": reason.strip(),
            "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "failed_checks": [c["name"] for c in checks if not c.get("passed")],
            # the person's "no" this override goes against, kept beside it
            "rejection": approval if (approval or {}).get("answer") != "Approve" else None,
        },
    }
    record(model, version, decision, None, mv=mv)
    return decision
