"""The promotion gate: a decision record of checks against the serving @champion.

`decide` is a pure function of the policy and the evaluation, and this module imports no MLflow:
`gate_record.run` stores the decision on the version and publishes it; who may then be released is
`eligibility`'s (from the version's tags).

Checks (each: name, value, threshold, passed, one-line reason):
* always: base compatibility; fairness gaps (demographic parity, equalized odds) per attribute; the
  calibration band; the latency budget; with no champion (first run) also an AUC floor and a
  logloss ceiling, and nothing else;
* against the champion: AUC and logloss non-inferiority, per-slot AUC non-inferiority, and with
  `superiority: true` a DeLong test (AUC difference > 0 at p < alpha); for a candidate judged on the days
  after its window (`lora.judged_on: next_day`), the sequential verdict over those days instead
  (`promotion.prequential`), next to the AUC floor;
* with `max_interference_cos` set: the largest |cos| between a slot adapter's LoRA update and those of
  the other slots' champions on its base stays under it (every run: a first champion may interfere too;
  the cold-start student, distilled from those champions, is not bounded).
A new base model (a version that records its own `fingerprint`) is gated by `decide_base`: AUC and
logloss against the serving base on the same holdout rows (first base: floor and ceiling) and calibration.
A check the evaluation could not measure (no fairness report, a fairness group too small, no clicks,
no latency sample, a slot with too few rows) FAILS and says so, unless the policy lists it in
`optional_checks`: silence is never a pass.
"""

from __future__ import annotations

from pipelines.config import GatePolicy, to_dict
from pipelines.metrics import check_result


def _check(name: str, value, threshold, passed: bool, reason: str) -> dict:
    return {"name": name, "value": value, "threshold": threshold, "passed": bool(passed), "reason": reason}


def _unmeasured(policy: GatePolicy, name: str, threshold, why: str) -> dict:
    if policy.is_optional(name):
        return _check(name, None, threshold, True, f"not measured: {why} (optional in the policy)")
    return _check(
        name,
        None,
        threshold,
        False,
        f"not measured: {why}; an unmeasured check fails unless the policy lists it in optional_checks",
    )


def base_check(base: dict) -> dict:
    """Base compatibility, the one definition (the gate, overrides and every alias move use it): the
    adapter's base fingerprint is recorded and equals the serving base's. `base` is `gate_record.fingerprints(mv)`."""
    cand, serving = base.get("candidate") or "", base.get("serving") or ""
    return _check(
        "base_compatible",
        cand[:12],
        serving[:12],
        bool(cand) and cand == serving,
        "the adapter's base fingerprint must equal the serving base's",
    )


def base_model_check() -> dict:
    """Base compatibility of a base model (a version that records its own fingerprint): there is no base
    under it to be compatible with, so it passes."""
    return _check("base_compatible", None, None, True, "a base model")


def _absolute(policy: GatePolicy, evaluation: dict) -> list[dict]:
    cand, rep = evaluation["candidate"], evaluation.get("report") or {}
    out = []
    for attr, f in sorted((rep.get("fairness") or {}).items()):
        for key, limit, what in (
            ("demographic_parity_difference", policy.max_demographic_parity_gap, "gap in mean pCTR between groups"),
            (
                "equalized_odds_difference",
                policy.max_equalized_odds_gap,
                "max TPR/FPR gap between groups at the serving threshold",
            ),
        ):
            name = f"fairness_{'dp' if key.startswith('demographic') else 'eo'}[{attr}]"
            v = f.get(key)
            out.append(
                _unmeasured(policy, name, limit, f"fewer than 2 {attr} groups with enough rows")
                if v is None
                else _check(name, v, limit, v <= limit, f"{what} ({attr}) must be <= {limit}")
            )
    if not rep.get("fairness"):  # no report, or one without a single attribute: nothing was measured
        out.append(
            _unmeasured(policy, "fairness", policy.max_demographic_parity_gap, "no fairness report in this evaluation")
        )
    # Judged on one later day, the day's own click rate moves both models out of the band alike: there the
    # candidate fails only where the champion, on the same rows, stays in it (the logloss evidence weighs the rest).
    judged_day = "sequential" in evaluation and evaluation.get("champion") is not None
    out.append(_calibration(policy, cand, evaluation["champion"] if judged_day else None))
    # An empty latency sample gives no batch_32 entry (evaluation.latency.pyfunc_latency returns {}).
    p99 = ((evaluation.get("latency") or {}).get("batch_32") or {}).get("p99_ms")
    out.append(
        _unmeasured(policy, "latency_p99_batch32_ms", policy.latency_budget_ms, "no latency sample in this evaluation")
        if p99 is None
        else _check(
            "latency_p99_batch32_ms",
            p99,
            policy.latency_budget_ms,
            p99 <= policy.latency_budget_ms,
            "pyfunc p99 latency at batch 32 must fit the budget",
        )
    )
    return out


def _calibration(policy: GatePolicy, cand: dict, champion: dict | None = None) -> dict:
    ratio = cand.get("calibration_ratio")
    band = [policy.calibration_min, policy.calibration_max]
    if ratio is None:
        return _unmeasured(policy, "calibration", band, "no clicks in the holdout")
    theirs = (champion or {}).get("calibration_ratio")
    if champion is not None and theirs is not None and not band[0] <= theirs <= band[1]:
        return _check(
            "calibration",
            ratio,
            band,
            True,
            f"out of the band on this day for the champion as well "
            f"({theirs:.3f}): the day's click rate moved, not the candidate",
        )
    return _check(
        "calibration", ratio, band, band[0] <= ratio <= band[1], "mean pCTR / observed CTR must lie in the band"
    )


def _first_run(policy: GatePolicy, cand: dict) -> list[dict]:
    c_auc, c_ll = cand.get("auc"), cand.get("logloss")
    return [
        _check(
            "auc_floor",
            c_auc,
            policy.min_auc_first_run,
            c_auc is not None and c_auc >= policy.min_auc_first_run,
            "first run: no champion, absolute AUC floor applies",
        ),
        _check(
            "logloss_ceiling",
            c_ll,
            policy.max_logloss_first_run,
            c_ll is not None and c_ll <= policy.max_logloss_first_run,
            "first run: no champion, absolute logloss ceiling applies",
        ),
    ]


def _auc_floor(policy: GatePolicy, cand: dict) -> dict:
    c_auc = cand.get("auc")
    return _check(
        "auc_floor_every_run",
        c_auc,
        policy.min_auc,
        c_auc is not None and c_auc >= policy.min_auc,
        "candidate AUC on its holdout must reach the floor whatever the champion scores: below it the "
        "holdout or the model is broken (e.g. a day of flipped labels)",
    )


def _non_inferiority(policy: GatePolicy, evaluation: dict) -> list[dict]:
    cand, champ, v = evaluation["candidate"], evaluation["champion"], evaluation.get("champion_version")
    out = []
    c_auc, ch_auc = cand.get("auc"), champ.get("auc")
    floor = None if ch_auc is None else ch_auc - policy.auc_tolerance
    out.append(
        _check(
            "auc_non_inferiority",
            c_auc,
            floor,
            c_auc is not None and floor is not None and c_auc >= floor,
            f"candidate AUC must be >= champion v{v} AUC {ch_auc} - {policy.auc_tolerance}",
        )
    )
    c_ll, ch_ll = cand.get("logloss"), champ.get("logloss")
    ceil = None if ch_ll is None else ch_ll + policy.logloss_tolerance
    out.append(
        _check(
            "logloss_non_inferiority",
            c_ll,
            ceil,
            c_ll is not None and ceil is not None and c_ll <= ceil,
            f"candidate logloss must be <= champion v{v} logloss {ch_ll} + {policy.logloss_tolerance}",
        )
    )
    return out


def _relative(policy: GatePolicy, evaluation: dict) -> list[dict]:
    out = _non_inferiority(policy, evaluation)
    if policy.superiority:
        d = evaluation.get("delong")
        ok = bool(d) and d["diff"] > 0 and d["p_value"] is not None and d["p_value"] < policy.superiority_alpha
        out.append(
            _check(
                "superiority_delong",
                None if not d else d["p_value"],
                policy.superiority_alpha,
                ok,
                "DeLong: AUC difference must be > 0 with p below alpha"
                if d
                else "DeLong test unavailable on this holdout: superiority cannot be shown",
            )
        )
    return out + _slots(policy, evaluation)


def _slots(policy: GatePolicy, evaluation: dict) -> list[dict]:
    """Per-slot AUC non-inferiority; a slot either side lacks, or no per-slot report at all, is unmeasured."""
    cand_slots = (evaluation.get("report") or {}).get("slots") or {}
    champ_slots = (evaluation.get("champion_report") or {}).get("slots") or {}
    if not cand_slots:
        return [_unmeasured(policy, "slot_auc", policy.slot_auc_tolerance, "no per-slot AUC in this evaluation")]
    out = []
    for slot in sorted(set(cand_slots) | set(champ_slots)):
        a, b = (cand_slots.get(slot) or {}).get("auc"), (champ_slots.get(slot) or {}).get("auc")
        tol = policy.slot_tolerance(slot)
        name = f"slot_auc[{slot}]"
        out.append(
            _unmeasured(policy, name, tol, "too few rows in this slot, or no AUC for it on one side")
            if a is None or b is None
            else _check(name, a, b - tol, a >= b - tol, f"slot {slot}: candidate AUC must be >= champion's - {tol}")
        )
    return out


def decide(policy: GatePolicy, evaluation: dict, base: dict | None = None) -> dict:
    """`base` = {"candidate": fingerprint the adapter was trained on, "serving": ctr_base@champion's}."""
    cand, champ = evaluation["candidate"], evaluation.get("champion")
    checks = [base_check(base)] if base is not None else []
    if champ is None:
        checks += _first_run(policy, cand)
    elif "sequential" in evaluation:  # judged on the days after its window: the evidence replaces the tolerances
        checks += [_auc_floor(policy, cand), _sequential(evaluation["sequential"])]
    else:
        checks += [_auc_floor(policy, cand), *_relative(policy, evaluation)]
    checks += _absolute(policy, evaluation)
    if policy.max_interference_cos is not None:
        checks.append(_interference(policy, evaluation))
    return _decision(policy, evaluation, checks)


def _sequential(seq: dict) -> dict:
    """The prequential verdict (promotion.sequential.decide over the days the candidate waited): passes on
    `release` only; its value is the bound the verdict read (the lower bound on the mean per-row logloss gain over
    the champion when the candidate carries the burden of proof, the upper one when the champion does)."""
    return _check(
        "sequential_non_inferiority",
        seq.get(seq.get("tested", "lower")),
        seq.get("bar"),
        seq.get("verdict") == "release",
        f"{seq.get('verdict')} after {seq.get('n')} judged rows over {seq.get('days')} day(s): {seq.get('reason')}",
    )


def _interference(policy: GatePolicy, evaluation: dict) -> dict:
    """|cos| against the sibling champions (evaluation.judge); with no sibling champion, or a zero update
    on either side, nothing interferes. An evaluation that did not measure it fails (unless optional)."""
    inter, bound = evaluation.get("interference") or {}, policy.max_interference_cos
    value, compared = inter.get("max_abs_cos"), inter.get("compared")
    if inter.get("bounded") is False:
        return _check(
            "interference",
            value,
            bound,
            True,
            "a cold-start student is distilled from the slot champions: aligned with them by construction, not bounded",
        )
    if value is None and compared is None:
        return _unmeasured(policy, "interference", bound, "no interference measurement in this evaluation")
    if value is None:
        return _check(
            "interference",
            None,
            bound,
            True,
            "no sibling champion to interfere with"
            if compared == 0
            else "no pair of non-zero LoRA updates (an id-rows-only adapter, or untrained)",
        )
    return _check(
        "interference",
        value,
        bound,
        value <= bound,
        f"largest |cos| with the other slots' champions ({inter.get('module')}) must be <= {bound}",
    )


def decide_base(policy: GatePolicy, evaluation: dict) -> dict:
    """A new base model against the serving base on the same holdout rows (`training.base_model`):
    AUC and logloss non-inferiority (the first base: the absolute floor and ceiling) and calibration.
    Fairness, latency, per-slot AUC and DeLong superiority are judged on what serves users, the
    adapters: each one retrained on this base passes the full gate before it serves."""
    cand, champ = evaluation["candidate"], evaluation.get("champion")
    checks = (
        _first_run(policy, cand) if champ is None else [_auc_floor(policy, cand), *_non_inferiority(policy, evaluation)]
    )
    return {**_decision(policy, evaluation, [*checks, _calibration(policy, cand)]), "kind": "base"}


def _decision(policy: GatePolicy, evaluation: dict, checks: list[dict]) -> dict:
    return {
        "passed": all(c["passed"] for c in checks),
        "first_run": evaluation.get("champion") is None,
        "champion_version": evaluation.get("champion_version"),
        "checks": checks,
        "policy": to_dict(policy),
    }


def format_table(decision: dict) -> str:
    def fmt(v):
        return f"{v:.5f}" if isinstance(v, float) else ("-" if v is None else str(v))

    rows = [("check", "value", "threshold", "result", "reason")]
    rows += [
        (c["name"], fmt(c["value"]), fmt(c["threshold"]), check_result(c), c["reason"]) for c in decision["checks"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    verdict = "PASSED" if decision["passed"] else "REJECTED"
    head = f"gate {verdict}" + (
        " (first run: no champion yet, absolute thresholds only)" if decision["first_run"] else ""
    )
    if decision.get("override"):
        o = decision["override"]
        head += f" — OVERRIDDEN by {o['actor']}: {o['reason']}"
    return "\n".join([head, *lines])
