"""What a `served` replay's recorded days say (`backtest_served.Served.days`): the decisions counted, the gate's
trust and precision against the next day's rows, and what stopped each injected fault. Pure: dicts in, dicts out.
"""

from __future__ import annotations

import math


def counts(days: list[dict]) -> dict:
    """gate_releases / gate_rejections / gate_held (candidates that passed and moved / failed the gate /
    passed while a canary was watched and were held),
    canary_promotions / canary_withdrawals, reverts, days_not_validated over the replayed days."""
    gates = [g for d in days for g in d.get("gate", {}).values() if "passed" in g]
    moves = [m for d in days for m in d.get("monitor", {}).get("moves", [])]
    return {
        "gate_releases": sum(g["released"] for g in gates),
        "gate_rejections": sum(g.get("rejections", int(not g["passed"])) for g in gates),
        "judge_waits": sum(
            j["verdict"] == "wait" for d in days for g in d.get("gate", {}).values() for j in g.get("judged", ())
        ),
        "gate_held": sum(bool(g.get("held")) for g in gates),
        "canary_promotions": sum(m["kind"] == "promote" for m in moves),
        "canary_withdrawals": sum(m["kind"] == "withdraw" for m in moves),
        "reverts": sum(len(d.get("monitor", {}).get("reverts", [])) for d in days),
        "days_not_validated": [d["date"] for d in days if not d.get("validated", True)],
    }


def trust(judged: list[dict], tolerance: float) -> dict:
    """Of the released candidates judged on the next day, the share worse than the champion they were
    gated against by more than `tolerance`; of the rejected ones, the share better by more than it."""
    tol = tolerance
    scored = [j for j in judged if j["candidate_auc"] is not None and j["against_auc"] is not None]
    released = [j for j in scored if j["released"]]
    rejected = [j for j in scored if not j["passed"]]
    worse = [j for j in released if j["candidate_auc"] < j["against_auc"] - tol]
    better = [j for j in rejected if j["candidate_auc"] > j["against_auc"] + tol]
    return {
        "tolerance": tol,
        "released_judged": len(released),
        "released_worse": len(worse),
        "released_worse_share": round(len(worse) / len(released), 3) if released else None,
        "rejected_judged": len(rejected),
        "rejected_better": len(better),
        "rejected_better_share": round(len(better) / len(rejected), 3) if rejected else None,
    }


def wilson(successes: int, n: int, z: float = 1.96) -> dict:
    """{"value", "lo", "hi", "n"}: a share and its Wilson score interval (None where n is 0)."""
    if n == 0:
        return {"value": None, "lo": None, "hi": None, "n": 0}
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {
        "value": round(p, 4),
        "lo": round(max(0.0, centre - half), 4),
        "hi": round(min(1.0, centre + half), 4),
        "n": n,
    }


def gate_precision(judged: list[dict]) -> dict:
    """Of the released candidates judged on the next day's rows of their slot (first champions have nothing
    to beat and are left out), the share whose AUC beat the champion they were gated against."""
    released = [j for j in judged if j["released"] and j["candidate_auc"] is not None and j["against_auc"] is not None]
    return wilson(sum(j["candidate_auc"] > j["against_auc"] for j in released), len(released))


def fault_outcome(days: list[dict], fault_day: str, revert_windows: int) -> dict:
    """What stopped the faulty day: `validation` (it never validated; `failed_checks` says which), `gate`
    (every candidate trained on it was rejected: on its holdout, or by the prequential judge on a later day),
    `monitor` (each released one was withdrawn as a canary or reverted as a champion within `revert_windows`
    days), `not_stopped`, or None (nothing was released, but not by the gate: a candidate passed and was held,
    was still waiting when the replay ended, or none was gated)."""
    at = next((i for i, d in enumerate(days) if d["date"] == fault_day), None)
    if at is None:
        return {"day": fault_day, "caught_by": None, "why": "the day is not in the replayed range"}
    if not days[at].get("validated", True):
        return {
            "day": fault_day,
            "caught_by": "validation",
            "failed_checks": days[at].get("failed_checks", []),
            "why": days[at].get("validation_error", "")[:200],
        }
    fates = _fates(days, at)
    released = {s: f["version"] for s, f in fates.items() if f.get("released")}
    if not released:
        passed = sorted(s for s, f in fates.items() if f.get("passed") is not False)
        if passed or not fates:
            return {
                "day": fault_day,
                "caught_by": None,
                "gate": fates,
                "why": "nothing trained on it was released, but the gate did not stop it: "
                + (
                    f"{passed} passed and were held, still waited or failed to train"
                    if passed
                    else "no candidate was gated"
                ),
            }
        failed = sorted({c for f in fates.values() for c in f.get("failed_checks", [])})
        return {
            "day": fault_day,
            "caught_by": "gate",
            "failed_checks": failed,
            "why": f"every candidate trained on it was rejected; failed {failed}",
        }
    went = min(f["at"] for f in fates.values() if f.get("released"))
    later = days[went + 1 : went + 1 + revert_windows]
    removed = {
        (m["model"], m.get("to_version"))
        for d in later
        for m in d.get("monitor", {}).get("moves", [])
        if m["kind"] == "withdraw"
    } | {(r["model"], "revert") for d in later for r in d.get("monitor", {}).get("reverts", [])}
    caught = all(any(model.endswith(slot) for model, _ in removed) for slot in released)
    return {
        "day": fault_day,
        "caught_by": "monitor" if caught else "not_stopped",
        "released": released,
        "why": f"released {released}; "
        + ("withdrawn or reverted" if caught else "still serving")
        + f" {revert_windows} days later",
        "removed": sorted(f"{m} {v or ''}".strip() for m, v in removed),
    }


def _fates(days: list[dict], at: int) -> dict[str, dict]:
    """slot -> what became of the candidate trained on `days[at]`: {"version", "passed" (None: undecided),
    "released", "failed_checks", "at": the day it was decided}; {"error", "passed": None} where none trained."""
    out = {}
    for slot, g in days[at].get("gate", {}).items():
        if "error" in g:
            out[slot] = {"error": g["error"], "passed": None}
        elif "trained" not in g:  # judged on its holdout the evening it trained
            out[slot] = {
                "version": g["version"],
                "passed": g["passed"],
                "released": g["released"],
                "failed_checks": g.get("failed_checks", []),
                "at": at,
            }
        else:
            out[slot] = _judged_fate(days, at, slot, g["trained"])
    return out


def _judged_fate(days: list[dict], at: int, slot: str, version: str) -> dict:
    """A candidate judged on the next days: it served if the faulty evening released it (as a successor) or a
    later evening released it itself. One that never served was stopped by the gate if it was rejected, or if
    the faulty evening's judgement rejected what would have let it out (a waiting one judged on the faulty
    rows: `judge_release: successor` releases the day's candidate on that judgement); otherwise None."""
    fate = {"version": version, "passed": None, "released": False, "failed_checks": [], "at": at}
    same = days[at].get("gate", {}).get(slot, {})
    if same.get("version") == version and same.get("released"):
        return {**fate, "passed": True, "released": True}
    for k in range(at + 1, len(days)):
        gate = days[k].get("gate", {}).get(slot, {})
        j = next((x for x in gate.get("judged", ()) if x["version"] == version), None)
        if gate.get("version") == version and gate.get("released"):
            return {**fate, "at": k, "passed": True, "released": True}
        if j is not None and j["verdict"] == "reject":
            return {**fate, "at": k, "passed": False, "failed_checks": rejected_checks(j)}
    refused = [x for x in same.get("judged", ()) if x["verdict"] == "reject"]
    if refused:
        return {**fate, "passed": False, "failed_checks": sorted({c for x in refused for c in rejected_checks(x)})}
    return fate


def rejected_checks(judged: dict) -> list[str]:
    return judged.get("failed") or ["sequential_non_inferiority"]
