"""The partition's meaning (`validation.consistency`): checks for faults that keep the schema. Each must be
quiet on real data (every MovieLens day, at the shipped thresholds) and must judge a one-valued column by
how many independent draws made it, not by its row count. Which fault each check stops, through the real
stage: test_bad_input_corpus.py; the faults themselves: tests/pipelines/bench/test_faults.py."""

from __future__ import annotations

import pandas as pd
import pytest

from pipelines.config import load_pipeline_config
from pipelines.data import movielens
from pipelines.validation.consistency import consistency_checks, reference

CFG = load_pipeline_config()
V = CFG.validation
LIMITS = dict(
    max_item_category_mismatch=V.max_item_category_mismatch,
    max_replayed_fraction=V.max_replayed_fraction,
    stuck_column_p=V.stuck_column_p,
    max_single_column_auc=V.max_single_column_auc,
    leak_min_rows=V.label_leak_min_rows,
)


def checks(frame: pd.DataFrame, ref_frames: list[pd.DataFrame] | None, **limits) -> dict[str, dict]:
    ref = reference(ref_frames) if ref_frames else None
    return {c["check"]: c for c in consistency_checks(frame, ref, slots=CFG.data.slots, **{**LIMITS, **limits})}


def test_no_movielens_day_fails_a_consistency_check_at_the_shipped_thresholds():
    frame = movielens.load()
    dates = frame["event_ts"].dt.strftime("%Y-%m-%d")
    days = {d: part.reset_index(drop=True) for d, part in frame.groupby(dates, sort=True)}
    order = list(days)
    failed = []
    for i, day in enumerate(order):
        ref = [days[d] for d in order[max(0, i - V.reference_partitions) : i]]
        failed += [(day, c) for c in checks(days[day], ref).values() if not c["passed"]]
    assert len(order) == 213 and failed == []


def rows(users: int, per_user: int = 3, gender=lambda u: "F", item=lambda u, k: f"i{u}-{k}", hour=10) -> pd.DataFrame:
    """`users` users with `per_user` rows each, at one hour of 1998-01-10, clicks on every other row."""
    n = users * per_user
    return pd.DataFrame(
        {
            "event_ts": pd.Timestamp("1998-01-10", tz="UTC")
            + pd.to_timedelta(range(n), unit="s")
            + pd.Timedelta(hours=hour),
            "user_id": [f"u{u}" for u in range(users) for _ in range(per_user)],
            "item_id": [item(u, k) for u in range(users) for k in range(per_user)],
            "slot": "morning",
            "label": [i % 2 for i in range(n)],
            "age_bucket": "25-34",
            "gender": [gender(u) for u in range(users) for _ in range(per_user)],
            "occupation": "writer",
            "category": "Drama",
            "hour": hour,
            "weekday": 5,
        }
    )


def mixed_reference() -> list[pd.DataFrame]:
    """A week whose genders are half F, half M, with every slot and a few categories and occupations."""
    ref = rows(200, gender=lambda u: "FM"[u % 2])
    ref["slot"] = [("morning", "afternoon", "night")[i % 3] for i in range(len(ref))]
    ref["category"] = [("Drama", "Comedy", "Action")[i % 3] for i in range(len(ref))]
    ref["occupation"] = [("writer", "student")[i % 2] for i in range(len(ref))]
    ref["age_bucket"] = [("25-34", "35-44")[i % 2] for i in range(len(ref))]
    ref["hour"] = [(8, 14, 22)[i % 3] for i in range(len(ref))]
    return [ref.assign(event_ts=ref["event_ts"] - pd.Timedelta(days=1))]


def test_one_gender_all_day_is_a_fault_only_when_many_users_make_it_improbable():
    one_user = checks(rows(1, per_user=300), mixed_reference())
    assert one_user["stuck_column[gender]"]["passed"]  # P = 0.5 ** 1 + 0.5 ** 1 = 1: one rater's day
    forty = checks(rows(40), mixed_reference())
    assert not forty["stuck_column[gender]"]["passed"]  # P = 2 * 0.5 ** 40 = 1.8e-12
    assert "1.8e-12" in forty["stuck_column[gender]"]["expected"]


def test_a_missing_slot_is_judged_by_user_hours_and_the_slots_reference_share():
    day = checks(rows(40), mixed_reference())  # 40 user-hours, every one in the morning
    assert not day["missing_slot[afternoon]"]["passed"] and not day["missing_slot[night]"]["passed"]
    few = checks(rows(5), mixed_reference())  # (2/3) ** 5 = 0.13: a quiet day
    assert few["missing_slot[night]"]["passed"]


def test_an_item_with_another_category_than_in_the_reference_is_counted():
    ref = mixed_reference()
    same_items = rows(200).assign(item_id=ref[0]["item_id"], category=ref[0]["category"])
    assert checks(same_items, ref)["item_category_consistency"]["observed"] == 0.0
    renamed = same_items.assign(category="Horror")
    assert checks(renamed, ref)["item_category_consistency"]["observed"] == 1.0


def test_the_same_impression_at_the_same_time_of_day_is_a_replay_a_new_one_is_not():
    ref = mixed_reference()
    resent = ref[0].assign(event_ts=ref[0]["event_ts"] + pd.Timedelta(days=1))
    assert checks(resent, ref)["replayed_rows"]["observed"] == 1.0
    a_second_later = resent.assign(event_ts=resent["event_ts"] + pd.Timedelta(microseconds=1))
    assert checks(a_second_later, ref)["replayed_rows"]["observed"] == 0.0


@pytest.mark.parametrize("n, leaked, failed", [(200, True, True), (200, False, False), (40, True, None)])
def test_a_column_that_alone_separates_the_labels_is_a_leak(n, leaked, failed):
    day = rows(n // 2, per_user=2)
    if leaked:
        day["hour"] = 12 * day["label"] + 3
    found = checks(day, None).get("label_leak")
    if failed is None:  # under label_leak_min_rows: not judged
        assert found is None
    else:
        assert found["passed"] is not failed
        assert not leaked or found["observed"] == {"column": "hour", "auc": 1.0}
