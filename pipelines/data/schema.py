"""The click-log contract (ARCHITECTURE §3): one row = one impression.

This module is the single definition of the columns; sources, the lake, validation and feature
encoding all read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from pipelines.errors import SchemaError


@dataclass(frozen=True)
class Column:
    name: str
    arrow_type: pa.DataType
    role: str  # "time" | "id" | "context" | "user" | "item" | "label"
    nullable: bool = False
    required: bool = True


COLUMNS: tuple[Column, ...] = (
    Column("event_ts", pa.timestamp("us", tz="UTC"), "time"),
    Column("user_id", pa.string(), "id"),
    Column("item_id", pa.string(), "id"),
    Column("slot", pa.string(), "context"),
    Column("label", pa.int8(), "label"),
    Column("age_bucket", pa.string(), "user", nullable=True),
    Column("gender", pa.string(), "user", nullable=True),
    Column("occupation", pa.string(), "user", nullable=True),
    Column("category", pa.string(), "item", nullable=True),
    Column("hour", pa.int8(), "context"),
    Column("weekday", pa.int8(), "context"),
    # Present in ad logs (synthetic source), absent from MovieLens.
    Column("advertiser_id", pa.string(), "item", nullable=True, required=False),
    # The item as words, for families that read text (model.text): an ad's title / a movie's title, and its
    # categories separated by spaces (every genre, where `category` keeps the first). Optional: a source
    # without text leaves them out, and the text family falls back to `category`.
    Column("item_title", pa.string(), "item", nullable=True, required=False),
    Column("item_genres", pa.string(), "item", nullable=True, required=False),
)

BY_NAME = {c.name: c for c in COLUMNS}
REQUIRED = tuple(c.name for c in COLUMNS if c.required)
ALL_NAMES = tuple(c.name for c in COLUMNS)
OPTIONAL = tuple(c.name for c in COLUMNS if not c.required)
# Fields the model sees, in a fixed order: the token order of the model input.
FEATURE_FIELDS = ("user_id", "item_id", "slot", "age_bucket", "gender", "occupation", "category", "hour", "weekday")


def arrow_schema(include_optional: bool | tuple[str, ...] = False) -> pa.Schema:
    """The required columns, plus every optional one (True) or the optional ones named."""
    cols = [
        c
        for c in COLUMNS
        if c.required
        or include_optional is True
        or (not isinstance(include_optional, bool) and c.name in include_optional)
    ]
    return pa.schema([pa.field(c.name, c.arrow_type, nullable=c.nullable) for c in cols])


def conform(df: pd.DataFrame, where: str = "frame") -> pd.DataFrame:
    """Return `df` with the contract's columns in contract order and dtypes.

    Raises SchemaError naming every missing column; extra columns are dropped here (the validation
    suite decides whether they are an error).
    """
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise SchemaError(f"{where}: missing required columns {missing}")
    out = pd.DataFrame(index=df.index)
    for c in COLUMNS:
        if c.name not in df.columns:
            continue
        s = df[c.name]
        try:
            if c.name == "event_ts":
                s = pd.to_datetime(s, utc=True, format="ISO8601").astype("datetime64[us, UTC]")
            elif pa.types.is_integer(c.arrow_type):
                v = pd.to_numeric(s)
                # astype("int8") alone wraps 300 to 44 and truncates 1.5 to 1: refuse instead.
                if v.isna().any() or (v != v.round()).any() or (v < -128).any() or (v > 127).any():
                    raise SchemaError(f"{where}: column {c.name!r} has values that are not int8 integers")
                s = v.astype("int8")
            else:
                s = s.astype("string")
        except (TypeError, ValueError) as exc:
            raise SchemaError(f"{where}: column {c.name!r} cannot be cast to {c.arrow_type}: {exc}") from exc
        out[c.name] = s
    return out.reset_index(drop=True)


def to_arrow(df: pd.DataFrame) -> pa.Table:
    df = conform(df)
    schema = arrow_schema(include_optional=tuple(c for c in OPTIONAL if c in df.columns))
    try:
        return pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    except (ValueError, pa.ArrowInvalid) as exc:  # e.g. a null in a non-nullable column
        raise SchemaError(f"frame does not fit the click-log schema: {exc}") from exc
