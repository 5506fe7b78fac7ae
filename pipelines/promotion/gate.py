"""The promotion gate: a decision record of checks against the serving @champion.

`decide` is a pure function of the policy and the evaluation; `run` stores the record on the
version (tags + JSON artifact on its training run), prints it as a table, and promotes on pass.
"""
from __future__ import annotations

import json
import logging

from pipelines.config import GatePolicy, to_dict

log = logging.getLogger(__name__)


def _check(name: str, value, threshold, passed: bool, reason: str) -> dict:
    return {"name": name, "value": value, "threshold": threshold, "passed": bool(passed), "reason": reason}


def decide(policy: GatePolicy, evaluation: dict, base: dict | None = None) -> dict:
    """`base` = {"candidate": fingerprint the adapter was trained on, "serving": ctr_base@champion's}."""
    cand, champ = evaluation["candidate"], evaluation.get("champion")
    checks = []
    if base is not None:
        checks.append(_check("base_compatible", (base.get("candidate") or "")[:12], (base.get("serving") or "")[:12],
                             bool(base.get("candidate")) and base.get("candidate") == base.get("serving"),
                             "the adapter's base fingerprint must equal the serving base's"))
    c_auc = cand.get("auc")
    if champ is None:
        checks.append(_check("auc_floor", c_auc, policy.min_auc_first_run,
                             c_auc is not None and c_auc >= policy.min_auc_first_run,
                             "first run: no champion, absolute AUC floor applies"))
        c_ll = cand.get("logloss")
        checks.append(_check("logloss_ceiling", c_ll, policy.max_logloss_first_run,
                             c_ll is not None and c_ll <= policy.max_logloss_first_run,
                             "first run: no champion, absolute logloss ceiling applies"))
    else:
        ch_auc = champ.get("auc")
        floor = None if ch_auc is None else ch_auc - policy.auc_tolerance
        ok = c_auc is not None and floor is not None and c_auc >= floor
        checks.append(_check("auc_non_inferiority", c_auc, floor, ok,
                             f"candidate AUC must be >= champion v{evaluation.get('champion_version')} AUC "
                             f"{ch_auc} - {policy.auc_tolerance}"))
    return {"passed": all(c["passed"] for c in checks), "first_run": champ is None,
            "champion_version": evaluation.get("champion_version"), "checks": checks, "policy": to_dict(policy)}


def format_table(decision: dict) -> str:
    def fmt(v):
        return f"{v:.5f}" if isinstance(v, float) else str(v)

    rows = [("check", "value", "threshold", "result", "reason")]
    rows += [(c["name"], fmt(c["value"]), fmt(c["threshold"]), "PASS" if c["passed"] else "FAIL", c["reason"])
             for c in decision["checks"]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    verdict = "PASSED" if decision["passed"] else "REJECTED"
    head = f"gate {verdict}" + (" (first run: no champion yet, absolute thresholds only)" if decision["first_run"] else "")
    return "\n".join([head, *lines])


def run(policy: GatePolicy, model: str, version: str, evaluation: dict, actor: str = "cli") -> dict:
    """Decide, record the decision on the version, and promote it to @champion when it passes."""
    from pipelines.promotion import aliases
    from pipelines.registry import mlflow_io, model_card

    c = mlflow_io.client()
    mv = c.get_model_version(model, version)
    serving = mlflow_io.version_by_alias(mv.tags.get("base.name", "ctr_base"), "champion")
    decision = decide(policy, evaluation, base={"candidate": mv.tags.get("base.fingerprint"),
                                                "serving": serving.tags.get("fingerprint") if serving else None})
    c.set_model_version_tag(model, version, "gate.passed", "true" if decision["passed"] else "false")
    c.set_model_version_tag(model, version, "gate.first_run", str(decision["first_run"]).lower())
    c.set_model_version_tag(model, version, "gate.checks", json.dumps(
        [{k: ch[k] for k in ("name", "value", "threshold", "passed")} for ch in decision["checks"]]))
    if mv.run_id:
        c.log_dict(mv.run_id, decision, f"gate/decision_v{version}.json")
    log.info("%s v%s\n%s", model, version, format_table(decision))
    model_card.publish(model, version, evaluation=evaluation, decision=decision)
    decision["model"], decision["version"] = model, version
    if decision["passed"]:
        move = aliases.move_alias(model, "champion", version, kind="promote", actor=actor,
                                  reason="passed gate" + (" (first run)" if decision["first_run"] else
                                                          f" against v{decision['champion_version']}"))
        decision["promoted"] = move["moved"]
    else:
        decision["promoted"] = False
    return decision
