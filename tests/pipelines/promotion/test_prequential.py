"""The prequential gate's pure parts: the verdict a waiting candidate's evidence earns (sequential test, first
run, maximum wait), and how the gate reads a judged day (the evidence replaces the tolerances; safety checks stay;
the calibration band judges the candidate, not the day's click rate). The stage itself runs against a real
MLflow store in tests/pipelines/flows/test_prequential.py and through Airflow in tests/e2e/test_prequential_dag.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipelines.promotion.gate import decide
from pipelines.promotion.prequential import verdict
from pipelines.promotion.sequential import Evidence
from tests.pipelines.promotion.test_gate import POLICY, SAME, check, evaluation, failed

rng = np.random.default_rng(0)
BETTER = Evidence().add(rng.normal(0.01, 0.05, 5000))  # the candidate predicts rows better, clearly
WORSE = Evidence().add(rng.normal(-0.01, 0.05, 5000))
NOISE = Evidence().add(rng.normal(0.0, 0.05, 300))  # too little to tell


def test_clear_evidence_releases_or_rejects_at_the_first_look():
    assert verdict(POLICY, BETTER, days=1)["verdict"] == "release"
    assert verdict(POLICY, WORSE, days=1)["verdict"] == "reject"


def test_undecided_evidence_waits_until_the_maximum_wait_then_is_rejected():
    policy = replace(POLICY, judge_max_wait_days=3)
    assert [verdict(policy, NOISE, days=d)["verdict"] for d in (1, 2, 3)] == ["wait", "wait", "reject"]
    assert "undecided after 3 judged day(s)" in verdict(policy, NOISE, days=3)["reason"]


def test_a_minimum_effect_asks_for_more_than_non_inferiority():
    small_gain = Evidence().add(rng.normal(0.002, 0.05, 20000))
    assert verdict(POLICY, small_gain, days=1)["verdict"] == "release"
    assert verdict(replace(POLICY, judge_min_effect=0.01), small_gain, days=1)["verdict"] != "release"


def test_with_the_burden_on_the_champion_noise_releases_harm_rejects_and_few_rows_wait():
    policy = replace(POLICY, judge_burden="champion")
    assert verdict(POLICY, NOISE, days=1)["verdict"] == "wait"  # the candidate's burden: it waits for evidence
    released = verdict(policy, NOISE, days=1)
    assert released["verdict"] == "release" and released["tested"] == "upper"
    assert verdict(policy, WORSE, days=1)["verdict"] == "reject"
    few = Evidence().add(rng.normal(0.0, 0.05, 50))
    assert [verdict(policy, few, days=d)["verdict"] for d in (1, 2)] == ["wait", "reject"]


def test_the_gate_reads_the_bound_the_verdict_tested():
    ev = judged("release")
    ev["sequential"].update(tested="upper", upper=0.004, bar=-0.01)
    assert check(decide(POLICY, ev, base=SAME), "sequential_non_inferiority")["value"] == 0.004


def test_with_no_champion_the_first_run_checks_decide():
    assert verdict(POLICY, None, days=1)["verdict"] == "release"


def judged(seq_verdict: str, **kw) -> dict:
    ev = evaluation(**kw)
    ev["sequential"] = {"verdict": seq_verdict, "lower": 0.001, "bar": 0.0, "n": 800, "days": 2, "reason": "r"}
    return ev


def test_the_evidence_replaces_the_tolerances_and_the_safety_checks_stay():
    d = decide(POLICY, judged("release", cand_auc=0.60, champ_auc=0.75), base=SAME)  # a day's AUC gap is not it
    names = [c["name"] for c in d["checks"]]
    assert d["passed"] and "auc_non_inferiority" not in names and "slot_auc[morning]" not in names
    assert names[:3] == ["base_compatible", "auc_floor_every_run", "sequential_non_inferiority"]
    assert failed(decide(POLICY, judged("wait"), base=SAME)) == ["sequential_non_inferiority"]
    assert failed(decide(POLICY, judged("release", cand_auc=0.4), base=SAME)) == ["auc_floor_every_run"]
    assert failed(decide(POLICY, judged("release", p99=500.0), base=SAME)) == ["latency_p99_batch32_ms"]


def test_on_a_judged_day_the_calibration_band_judges_the_candidate_not_the_days_click_rate():
    day_moved = judged("release", calibration=2.0)
    day_moved["champion"]["calibration_ratio"] = 1.9  # the champion is out of the band on these rows too
    assert check(decide(POLICY, day_moved, base=SAME), "calibration")["passed"]
    own = judged("release", calibration=2.0)
    own["champion"]["calibration_ratio"] = 1.0  # the champion is fine: the candidate is off
    assert failed(decide(POLICY, own, base=SAME)) == ["calibration"]
    holdout = evaluation(calibration=2.0)  # judged on its holdout: the band, as always
    holdout["champion"]["calibration_ratio"] = 1.9
    assert "calibration" in failed(decide(POLICY, holdout, base=SAME))
