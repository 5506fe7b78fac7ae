"""ctr_lora_retrain with `lora.judged_on: next_day`, through real Airflow DAG runs (`airflow dags test`) on
MovieLens in S3 (moto's server): each run judges the slots' waiting candidates on its day, releases the ready
ones' successors (the shipped `judge_release: successor`): the day's candidates, trained on their whole window."""

from __future__ import annotations

import json

import pytest

from tests.e2e.stack import CANARY, JUDGE_PASSABLE, movielens_stack
from tests.e2e.test_lifecycle_dags import current, versions

pytestmark = pytest.mark.slow

DAYS = ("1998-03-01", "1998-03-02", "1998-03-03")
SLOTS = ("morning", "afternoon", "night")
PASSABLE = {**JUDGE_PASSABLE, **CANARY}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    with movielens_stack(
        tmp_path_factory.mktemp("e2e-prequential"),
        "e2e-prequential",
        DAYS[-1],
        paths=PASSABLE,
        lora={"judged_on": "next_day"},
    ) as st:
        st.airflow("dags", "test", "ctr_base_model", "1997-12-31")
        yield st


def test_each_run_judges_yesterdays_candidates_then_trains_todays_and_releases_it_in_their_place(stack):
    stack.airflow("dags", "test", "ctr_lora_retrain", DAYS[0])
    for slot in SLOTS:  # nothing waited: the day's candidate trains on its whole window and waits
        (v1,) = versions(f"ctr_lora_{slot}")
        assert v1.tags["judge.state"] == "waiting" and v1.tags["gate.passed"] == "pending"
        assert v1.tags["judge.trained_through"] == DAYS[0] and v1.tags["data.last"] == DAYS[0]
        assert current(f"ctr_lora_{slot}") is None

    stack.airflow("dags", "test", "ctr_lora_retrain", DAYS[1])
    for slot in SLOTS:  # v1 judged on DAYS[1]'s rows (no champion: the first-run checks); v2 goes out in its place
        v1, v2 = versions(f"ctr_lora_{slot}")
        assert v1.tags["judge.state"] == "release" and v1.tags["judge.handed_over"] == "2"
        assert json.loads(v1.tags["judge.evidence"])["last_day"] == DAYS[1]
        assert v2.tags["judge.successor_of"] == "1" and v2.tags["gate.passed"] == "true", v2.tags.get("gate.checks")
        assert v2.tags["judge.trained_through"] == DAYS[1] and current(f"ctr_lora_{slot}") == "2"

    stack.airflow("dags", "test", "ctr_lora_retrain", DAYS[2])
    for slot in SLOTS:  # v2, serving, judged on DAYS[2]; its pass releases v3 next to it, to @canary
        v1, v2, v3 = versions(f"ctr_lora_{slot}")
        assert json.loads(v2.tags["judge.evidence"])["last_day"] == DAYS[2] and v2.tags["judge.handed_over"] == "3"
        assert v3.tags["judge.successor_of"] == "2" and v3.tags["judge.replaced"] == "2"
        assert current(f"ctr_lora_{slot}", "canary") == "3" and current(f"ctr_lora_{slot}") == "2"
        assert v3.tags["judge.state"] == "waiting"  # the next day judges it beside the champion
