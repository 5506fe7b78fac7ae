"""The champion monitor's decisions (`pipelines.promotion.monitor_decisions`) as pure functions of window
records: when a canary is promoted, withdrawn or kept waiting, when a champion is reverted, and which
reference its metric is judged against. `monitor_day` on a real store is test_monitor.py.
"""

from __future__ import annotations

from dataclasses import replace

from pipelines.promotion.monitor_decisions import Window, canary_decision, reference_value, revert_decision
from tests.pipelines.promotion.test_monitor import MODEL, POLICY


def w(alias: str, version: str, day: int, auc: float | None, champion_version: str = "", **metrics) -> Window:
    return Window(
        model=MODEL,
        alias=alias,
        version=version,
        day=f"2024-02-{day:02d}",
        metrics={"auc": auc, **metrics},
        champion_version=champion_version,
    )


def paired(days_aucs: list[tuple[int, float, float]], canary: str = "3", champion: str = "2") -> list[Window]:
    out = []
    for day, can, champ in days_aucs:
        out += [w("champion", champion, day, champ), w("canary", canary, day, can, champion_version=champion)]
    return out


def test_healthy_windows_promote_the_canary():
    d = canary_decision(paired([(1, 0.70, 0.71), (2, 0.69, 0.70)]), POLICY)
    assert d.action == "promote" and d.days == ("2024-02-01", "2024-02-02")
    assert "canary v3" in d.reason and "champion v2" in d.reason and "0.6900 vs 0.7000" in d.reason


def test_one_healthy_window_waits_and_says_how_many():
    d = canary_decision(paired([(1, 0.70, 0.71)]), POLICY)
    assert d.action == "wait" and "1/2 healthy" in d.reason


def test_exactly_at_the_tolerance_is_healthy_and_just_below_withdraws():
    assert canary_decision(paired([(1, 0.67, 0.70), (2, 0.67, 0.70)]), POLICY).action == "promote"
    d = canary_decision(paired([(1, 0.70, 0.70), (2, 0.6699, 0.70)]), POLICY)
    assert d.action == "withdraw" and d.days == ("2024-02-02",)
    assert "0.6699 < champion v2 AUC 0.7000 - tolerance 0.03 on dt=2024-02-02" in d.reason


def test_a_bad_window_in_between_restarts_the_count():
    d = canary_decision(paired([(1, 0.70, 0.70), (2, 0.50, 0.70), (3, 0.70, 0.70)]), POLICY)
    assert d.action == "wait" and "1/2" in d.reason


def test_a_new_champion_restarts_the_canary_pair():
    windows = paired([(1, 0.70, 0.70)], champion="2") + paired([(2, 0.70, 0.70)], champion="4")
    d = canary_decision(windows, POLICY)
    assert d.action == "wait" and "champion v4" in d.reason
    # and only the asked-for pair counts
    assert canary_decision(windows, POLICY, canary_version="9").action == "wait"


def test_windows_without_an_auc_or_a_partner_are_no_evidence():
    windows = paired([(1, 0.70, 0.70)]) + [
        w("canary", "3", 2, None, "2"),
        w("champion", "2", 2, 0.7),
        w("canary", "3", 3, 0.70, "7"),
    ]  # its champion v7 was never scored
    assert canary_decision(windows, POLICY).action == "wait"
    assert canary_decision([], POLICY).action == "wait"


def champ(days_aucs: list[tuple[int, float | None]], version: str = "2") -> list[Window]:
    return [w("champion", version, d, a) for d, a in days_aucs]


def test_revert_after_k_consecutive_bad_windows_and_not_after_k_minus_1():
    # reference 0.70, drop 0.15: floor 0.595
    assert revert_decision(champ([(1, 0.70), (2, 0.50)]), 0.70, POLICY).action == "keep"
    d = revert_decision(champ([(1, 0.70), (2, 0.50), (3, 0.59)]), 0.70, POLICY)
    assert d.action == "revert" and d.days == ("2024-02-02", "2024-02-03")
    assert "below 0.5950" in d.reason and "dt=2024-02-02 0.5000, dt=2024-02-03 0.5900" in d.reason


def test_a_good_window_interrupts_the_streak():
    d = revert_decision(champ([(1, 0.50), (2, 0.60), (3, 0.50)]), 0.70, POLICY)
    assert d.action == "keep" and "1/2" in d.reason


def test_at_the_floor_is_not_bad():
    assert revert_decision(champ([(1, 0.595), (2, 0.595)]), 0.70, POLICY).action == "keep"


def test_a_different_champion_version_resets_the_streak():
    windows = champ([(1, 0.50)], version="1") + champ([(2, 0.50)], version="2")
    assert revert_decision(windows, 0.70, POLICY).action == "keep"
    # the version asked for, not the latest window's: its streak ended when v2 took over
    assert (
        revert_decision(champ([(1, 0.5), (2, 0.5)], "1") + champ([(3, 0.9)], "2"), 0.7, POLICY, version="1").action
        == "keep"
    )


def test_canary_windows_do_not_count_towards_a_revert():
    windows = [w("canary", "2", 1, 0.5, "1"), w("canary", "2", 2, 0.5, "1"), w("champion", "2", 3, 0.5)]
    assert revert_decision(windows, 0.70, POLICY).action == "keep"


def test_missing_metric_windows_neither_count_nor_break_the_streak():
    windows = champ([(1, 0.50), (2, None), (3, 0.50)])
    assert revert_decision(windows, 0.70, POLICY).action == "revert"
    assert revert_decision(champ([(1, None), (2, None), (3, None)]), 0.70, POLICY).action == "keep"


def test_no_reference_never_reverts():
    assert revert_decision(champ([(1, 0.1), (2, 0.1)]), None, POLICY).action == "keep"


def test_live_ctr_is_the_ctr_metric():
    policy = replace(POLICY, revert_metric="ctr")
    windows = [w("champion", "2", d, 0.7, live_ctr=c, ctr=0.1) for d, c in ((1, 0.10), (2, 0.08), (3, 0.08))]
    assert revert_decision(windows, 0.10, policy).action == "revert"  # 0.08 < 0.085
    assert (
        revert_decision([replace(x, metrics={"auc": 0.7, "ctr": 0.01}) for x in windows], 0.10, policy).action == "keep"
    )  # observed CTR is not live CTR


def test_reference_is_the_registration_auc_else_the_first_window():
    windows = champ([(3, 0.61), (4, 0.55)]) + [w("canary", "2", 2, 0.64, "1")]
    assert reference_value(POLICY, {"eval.candidate": '{"auc": 0.66}'}, windows, "2") == (
        0.66,
        "eval.candidate (holdout AUC at registration)",
    )
    assert reference_value(POLICY, {"eval.candidate": "not json"}, windows, "2") == (
        0.64,
        "first monitored window dt=2024-02-02 (canary)",
    )
    assert reference_value(POLICY, {}, windows, "5") == (None, "none yet")
    live = [w("champion", "2", 1, 0.7, live_ctr=0.12), w("champion", "2", 2, 0.7, live_ctr=0.05)]
    assert (
        reference_value(replace(POLICY, revert_metric="ctr"), {"eval.candidate": '{"auc": 0.66}'}, live, "2")[0] == 0.12
    )
