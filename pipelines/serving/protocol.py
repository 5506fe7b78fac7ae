"""MLflow's scoring protocol, as `POST /invocations` of `python -m pipelines serve` speaks it.

Pure parsing: a decoded JSON body in, a contract-typed DataFrame out, or a `RequestError` naming what
is wrong and where (the HTTP front turns it into a 4xx; a request never reaches the model unchecked).

Accepted bodies, as `mlflow models serve` accepts them for a DataFrame model:

* `{"dataframe_split": {"columns": [...], "data": [[...], ...]}}` (optionally "index", ignored);
* `{"dataframe_records": [{"col": value, ...}, ...]}`;

plus an optional `"params"` object (accepted and unused: the server has no per-request parameters).
Each row carries the click-log fields the served base's family reads (`columns(cfg)`), typed as the
contract says: ids and categories are strings (null where the contract allows), `hour` / `weekday`
integers in int8 range; `is_new_user` is an optional boolean. A `slot` the server does not serve is
refused: the router would give it the base's output, and a caller with a typo would never know.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from pipelines.data import schema

NEW_USER_COLUMN = "is_new_user"
MAX_ROWS = 10_000
_IGNORED = ("label", "event_ts")  # contract columns a scoring request may carry and the model never reads


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse(body: object, *, required: Sequence[str], slots: Sequence[str], max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """The rows of a decoded scoring body as a DataFrame: the `required` columns (and any other contract
    column present) typed as the contract says, and `is_new_user` as bool when present."""
    wanted = (
        *[c for c in schema.ALL_NAMES if c not in _IGNORED],
        *[c for c in required if c not in schema.BY_NAME],
        NEW_USER_COLUMN,
    )
    frame, n = _columns(body, max_rows, wanted)
    if n == 0:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in frame}, index=range(0))
    missing = [c for c in required if c not in frame]
    if missing:
        raise RequestError(f"rows are missing the fields {missing} (this server's model reads {list(required)})", 422)
    out = {}
    for name, values in frame.items():
        if name in schema.BY_NAME:
            out[name] = _typed(values, schema.BY_NAME[name])
        elif name == NEW_USER_COLUMN:
            out[name] = _booleans(values)
        else:  # a field a user's family reads beyond the contract: passed on as sent, its family checks it
            out[name] = pd.array(values, dtype=object)
    out = pd.DataFrame(out, index=range(n))
    if "slot" in out:
        unknown = (~out["slot"].isin(slots)).tolist()
        if any(unknown):
            bad = sorted({s for s, u in zip(out["slot"], unknown) if u})
            raise RequestError(
                f"unknown slot(s) {bad[:10]} at rows {_rows(unknown)}; this server serves {list(slots)}", 422
            )
    return out


def _columns(body: object, max_rows: int, wanted: Sequence[str]) -> tuple[dict[str, list], int]:
    """({column: values as sent}, row count) of the `wanted` columns only (no type guessing, and a
    record's other keys never become columns). Plain lists: checking and typing a column per request
    costs microseconds here, against about a millisecond per column through pandas Series."""
    if not isinstance(body, Mapping):
        raise RequestError("the body must be a JSON object with 'dataframe_split' or 'dataframe_records'")
    formats = [k for k in ("dataframe_split", "dataframe_records") if k in body]
    extra = sorted(set(body) - {"dataframe_split", "dataframe_records", "params"})
    if len(formats) != 1 or extra:
        raise RequestError(
            "the body needs exactly one of 'dataframe_split' or 'dataframe_records' (and "
            f"optionally 'params'); got keys {sorted(body)}"
        )
    if "params" in body and not isinstance(body["params"], Mapping):
        raise RequestError("'params' must be a JSON object")
    payload = body[formats[0]]
    if formats[0] == "dataframe_split":
        if (
            not isinstance(payload, Mapping)
            or not isinstance(payload.get("columns"), list)
            or not isinstance(payload.get("data"), list)
        ):
            raise RequestError("'dataframe_split' must be an object with a 'columns' list and a 'data' list")
        columns, data = payload["columns"], payload["data"]
        if not all(isinstance(c, str) for c in columns) or len(set(columns)) != len(columns):
            raise RequestError("'dataframe_split.columns' must be distinct strings")
        _check_rows(len(data), max_rows)
        for i, row in enumerate(data):
            if not isinstance(row, list) or len(row) != len(columns):
                raise RequestError(f"'dataframe_split.data' row {i} must be a list of {len(columns)} values")
        keep = [i for i, c in enumerate(columns) if c in wanted]
        return {columns[i]: [row[i] for row in data] for i in keep}, len(data)
    if not isinstance(payload, list):
        raise RequestError("'dataframe_records' must be a list of objects")
    _check_rows(len(payload), max_rows)
    for i, row in enumerate(payload):
        if not isinstance(row, Mapping):
            raise RequestError(f"'dataframe_records' row {i} must be an object")
    present = [c for c in wanted if any(c in row for row in payload)]
    return {c: [row.get(c) for row in payload] for c in present}, len(payload)


def _check_rows(n: int, max_rows: int) -> None:
    if n > max_rows:
        raise RequestError(f"{n} rows in one request; at most {max_rows}", 413)


def _null(v: object) -> bool:
    """JSON null, or NaN (`json.loads` accepts it; pandas writes missing values so)."""
    return v is None or (type(v) is float and v != v)


def _typed(values: list, column: schema.Column):
    nulls = [_null(v) for v in values]
    if any(nulls) and not column.nullable:
        raise RequestError(f"field {column.name!r} is null at rows {_rows(nulls)}; it is required", 422)
    if pa.types.is_integer(column.arrow_type):
        _refuse(
            values,
            [not (type(v) is int and -128 <= v <= 127) for v in values],
            column.name,
            "an integer in [-128, 127]",
        )
        return np.array(values, dtype=np.int8)
    _refuse(
        values,
        [not (n or isinstance(v, str)) for v, n in zip(values, nulls)],
        column.name,
        "a string" + (" or null" if column.nullable else ""),
    )
    return pd.array([None if n else v for v, n in zip(values, nulls)], dtype="string")


def _booleans(values: list) -> np.ndarray:
    """A missing flag (null, or absent from some records) is False, as an absent column is."""
    nulls = [_null(v) for v in values]
    _refuse(
        values, [not (n or isinstance(v, bool)) for v, n in zip(values, nulls)], NEW_USER_COLUMN, "true, false or null"
    )
    return np.array([not n and bool(v) for v, n in zip(values, nulls)], dtype=bool)


def _refuse(values: list, bad: list[bool], name: str, expected: str) -> None:
    if any(bad):
        first = values[bad.index(True)]
        raise RequestError(f"field {name!r} must be {expected}; rows {_rows(bad)} are not (first: {first!r:.60})", 422)


def _rows(mask: list[bool]) -> list[int]:
    return [i for i, b in enumerate(mask) if b][:10]
