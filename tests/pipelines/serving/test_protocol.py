"""MLflow's scoring protocol as the HTTP front parses it: typed rows out, or a RequestError with a status."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pipelines.data.schema import FEATURE_FIELDS
from pipelines.serving import protocol
from pipelines.serving.protocol import RequestError, parse

SLOTS = ("feed", "search")
ROW = {
    "user_id": "u1",
    "item_id": "i2",
    "slot": "feed",
    "age_bucket": "25-34",
    "gender": None,
    "occupation": "writer",
    "category": "Drama",
    "hour": 9,
    "weekday": 2,
}


def _parse(body, **kw):
    return parse(body, required=FEATURE_FIELDS, slots=SLOTS, **kw)


def test_split_and_records_give_the_same_typed_frame():
    split = {"dataframe_split": {"columns": list(ROW), "data": [list(ROW.values())] * 2}}
    a, b = _parse(split), _parse({"dataframe_records": [ROW, ROW], "params": {}})
    pd.testing.assert_frame_equal(a, b)
    assert str(a["hour"].dtype) == "int8" and str(a["user_id"].dtype) == "string" and a["gender"].isna().all()


def test_the_new_user_flag_is_kept_as_bool_missing_is_false_and_label_and_time_are_dropped():
    out = _parse(
        {
            "dataframe_records": [
                {**ROW, "is_new_user": True, "label": 1, "event_ts": "2024-01-01"},
                ROW,
                {**ROW, "is_new_user": None},
            ]
        }
    )
    assert out["is_new_user"].tolist() == [True, False, False] and "label" not in out and "event_ts" not in out


@pytest.mark.parametrize(
    "change, status, words",
    [
        ({"hour": "9"}, 422, "'hour'"),
        ({"hour": True}, 422, "'hour'"),
        ({"weekday": 128}, 422, "'weekday'"),
        ({"user_id": 5}, 422, "'user_id'"),
        ({"item_id": None}, 422, "null"),
        ({"slot": "splash"}, 422, "splash"),
        ({"is_new_user": "yes"}, 422, "'is_new_user'"),
    ],
)
def test_a_bad_value_names_its_field_and_row(change, status, words):
    with pytest.raises(RequestError, match=words) as e:
        _parse({"dataframe_records": [ROW, {**ROW, **change}]})
    assert e.value.status == status and "[1]" in str(e.value)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"dataframe_records": [{k: v for k, v in ROW.items() if k != "category"}]}, 422),
        ({"instances": [ROW]}, 400),
        ({"dataframe_records": [ROW], "dataframe_split": {}}, 400),
        ({"dataframe_records": [ROW], "params": []}, 400),
        ({"dataframe_split": {"columns": ["a", "a"], "data": []}}, 400),
        ({"dataframe_split": {"columns": list(ROW), "data": [[1]]}}, 400),
        ({"dataframe_records": ROW}, 400),
        ("rows", 400),
    ],
)
def test_a_body_that_is_not_the_protocol_is_refused(body, status):
    with pytest.raises(RequestError) as e:
        _parse(body)
    assert e.value.status == status and str(e.value)


def test_too_many_rows_is_413():
    with pytest.raises(RequestError) as e:
        _parse({"dataframe_records": [ROW] * 3}, max_rows=2)
    assert e.value.status == 413


def test_records_keep_only_the_fields_the_server_reads_and_their_values_as_sent():
    junk = [{**ROW, **{f"k{i}_{j}": 0 for j in range(50)}} for i in range(200)]  # 10,000 distinct keys
    out = _parse({"dataframe_records": junk})
    assert list(out.columns) == [c for c in ROW] and len(out) == 200
    with pytest.raises(RequestError, match=r"rows \[1\]"):  # no float column guessed: row 0 stays valid
        _parse({"dataframe_records": [ROW, {**ROW, "hour": 7.5}]})


def test_no_rows_is_an_empty_frame():
    assert len(_parse({"dataframe_records": []})) == 0
    assert len(_parse({"dataframe_split": {"columns": list(ROW), "data": []}})) == 0


def test_nan_is_a_null_as_pandas_writes_missing_values():
    """`json.loads` accepts NaN; a DataFrame's missing values arrive so from `to_dict("records")` clients."""
    row = {
        "user_id": "u1",
        "item_id": "i1",
        "slot": "feed",
        "age_bucket": float("nan"),
        "gender": "F",
        "occupation": "x",
        "category": "c",
        "hour": 3,
        "weekday": 1,
        "is_new_user": float("nan"),
    }
    body = json.loads(json.dumps({"dataframe_records": [row]}))
    frame = protocol.parse(body, required=list(row)[:-1], slots=["feed"])
    assert frame["age_bucket"].isna().all() and frame["is_new_user"].tolist() == [False]
    with pytest.raises(protocol.RequestError, match="'user_id' is null"):
        protocol.parse(
            json.loads(json.dumps({"dataframe_records": [{**row, "user_id": float("nan")}]})),
            required=list(row)[:-1],
            slots=["feed"],
        )
