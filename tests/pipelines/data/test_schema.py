"""The click-log contract: conform() and to_arrow()."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from pipelines.data import schema
from pipelines.errors import SchemaError


def raw_frame(n: int = 4, with_advertiser: bool = False) -> pd.DataFrame:
    """Contract columns in the 'wrong' dtypes a source might deliver, shuffled, plus an extra column."""
    df = pd.DataFrame(
        {
            "label": [1, 0, 0, 1][:n],  # int64
            "event_ts": [
                "2024-01-01T00:00:01Z",
                "2024-01-01T05:30:00Z",
                "2024-01-01T12:00:00Z",
                "2024-01-01T23:59:59Z",
            ][:n],  # strings
            "user_id": [1, 2, 3, 4][:n],  # ints
            "item_id": ["i1", "i2", "i3", "i4"][:n],
            "slot": ["feed", "search", "splash", "feed"][:n],
            "age_bucket": ["18-24", None, "25-34", "56+"][:n],  # object with a null
            "gender": ["M", "F", "F", None][:n],
            "occupation": ["student", "other", "writer", "none"][:n],
            "category": ["retail", "auto", None, "food"][:n],
            "hour": [0.0, 5.0, 12.0, 23.0][:n],  # float
            "weekday": [0, 0, 0, 0][:n],
            "extra": ["x"] * n,
        },
        index=[10, 11, 12, 13][:n],
    )
    if with_advertiser:
        df["advertiser_id"] = [7, 8, 9, 7][:n]
    return df


def test_conform_casts_to_contract_dtypes_and_order():
    out = schema.conform(raw_frame())
    assert tuple(out.columns) == schema.REQUIRED
    assert str(out["event_ts"].dtype) == "datetime64[us, UTC]"
    for name in ("label", "hour", "weekday"):
        assert out[name].dtype == "int8", name
    for name in ("user_id", "item_id", "slot", "age_bucket", "gender", "occupation", "category"):
        assert isinstance(out[name].dtype, pd.StringDtype), name
    assert out["user_id"].tolist() == ["1", "2", "3", "4"]
    assert out["hour"].tolist() == [0, 5, 12, 23]
    assert out["event_ts"].iloc[1] == pd.Timestamp("2024-01-01 05:30", tz="UTC")
    assert out["age_bucket"].isna().tolist() == [False, True, False, False]
    assert list(out.index) == [0, 1, 2, 3]  # index reset
    assert "extra" not in out.columns  # extra columns dropped


def test_conform_keeps_optional_advertiser_id():
    out = schema.conform(raw_frame(with_advertiser=True))
    assert tuple(out.columns) == schema.REQUIRED + ("advertiser_id",)
    assert out["advertiser_id"].tolist() == ["7", "8", "9", "7"]
    assert isinstance(out["advertiser_id"].dtype, pd.StringDtype)


def test_conform_is_idempotent():
    once = schema.conform(raw_frame(with_advertiser=True))
    pd.testing.assert_frame_equal(schema.conform(once), once)


@pytest.mark.parametrize("column", ["user_id", "event_ts", "label"])
def test_missing_required_column_names_it(column):
    with pytest.raises(SchemaError, match=column) as info:
        schema.conform(raw_frame().drop(columns=[column]), where="src-x")
    assert "src-x" in str(info.value)


def test_missing_columns_are_all_named():
    with pytest.raises(SchemaError) as info:
        schema.conform(raw_frame().drop(columns=["slot", "hour"]))
    assert "slot" in str(info.value) and "hour" in str(info.value)


def test_missing_optional_column_is_fine():
    assert "advertiser_id" not in schema.conform(raw_frame()).columns


@pytest.mark.filterwarnings("ignore:Could not infer format")
def test_uncastable_value_is_schema_error_naming_the_column():
    df = raw_frame()
    df["hour"] = ["a", "b", "c", "d"]
    with pytest.raises(SchemaError, match="hour"):
        schema.conform(df)
    df = raw_frame()
    df["event_ts"] = ["not a time"] * 4
    with pytest.raises(SchemaError, match="event_ts"):
        schema.conform(df)


@pytest.mark.parametrize("with_advertiser", [False, True])
def test_to_arrow_schema_equals_arrow_schema(with_advertiser):
    table = schema.to_arrow(raw_frame(with_advertiser=with_advertiser))
    assert table.schema.equals(schema.arrow_schema(include_optional=("advertiser_id",) if with_advertiser else ()))
    assert table.num_rows == 4


def test_to_arrow_keeps_the_optional_columns_present_and_only_those():
    df = raw_frame(with_advertiser=False).assign(item_title=["a b", None, "c", "d"])
    table = schema.to_arrow(df)
    assert table.schema.names == list(schema.REQUIRED) + ["item_title"]
    assert table.column("item_title").to_pylist() == ["a b", None, "c", "d"]


def test_arrow_schema_fields():
    s = schema.arrow_schema()
    assert tuple(s.names) == schema.REQUIRED
    assert s.field("event_ts").type == pa.timestamp("us", tz="UTC")
    assert s.field("label").type == pa.int8()
    assert not s.field("user_id").nullable and s.field("gender").nullable
    assert tuple(schema.arrow_schema(include_optional=True).names) == schema.ALL_NAMES


def test_feature_fields_are_contract_columns():
    assert set(schema.FEATURE_FIELDS) <= set(schema.ALL_NAMES)
    assert "label" not in schema.FEATURE_FIELDS and "event_ts" not in schema.FEATURE_FIELDS
