"""The click-log expectation suite, generated from the contract (`pipelines.data.schema`) and config.

Only GX's own expectations are used; this module turns their results into a short JSON-safe report
(the task log / XCom carries it); the validation stage raises DataValidationError from its failures.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

# Before importing GX: 1.24 ships no analytics client, but earlier/later releases read this at
# import/context time, and tasks must never call out. Its import also logs at INFO.
os.environ["GX_ANALYTICS_ENABLED"] = "false"
logging.getLogger("great_expectations").setLevel(logging.WARNING)

import great_expectations as gx  # noqa: E402
import great_expectations.expectations as gxe  # noqa: E402
from great_expectations.data_context.types.base import ProgressBarsConfig  # noqa: E402

from pipelines.config import config_hash  # noqa: E402


def _quiet_gx_logs() -> None:
    """Some GX modules pin their own logger to INFO (e.g. the ephemeral docs-site notice); undo that."""
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith("great_expectations.") and isinstance(lg, logging.Logger) and lg.level < logging.WARNING:
            lg.setLevel(logging.NOTSET)  # inherit WARNING from "great_expectations"


_quiet_gx_logs()

from pipelines.config import ValidationConfig  # noqa: E402
from pipelines.data import schema  # noqa: E402

SUITE_NAME = "click_log_contract"
# The column-set check is parameterised: optional contract columns (advertiser_id) may be absent,
# so its set is "the contract columns this frame has" and only extra columns can fail it.
_COLUMNS_PARAM = "contract_columns_present"

# GX 1.x's pandas dtype checks compare against the dtype's scalar type (ExpectColumnValuesToBeOfType)
# or the dtype object (ExpectColumnValuesToBeInTypeList). "str" is the only name that matches every
# pandas string flavour (pandas 3 `str`, `string`, object-of-str), and "Timestamp" the only one that
# matches tz-aware datetimes; integers need InTypeList to accept any width, numpy or nullable.
_INT_TYPES = [f"{p}int{b}" for p in ("", "u") for b in (8, 16, 32, 64)] + [
    f"{p}Int{b}Dtype" for p in ("", "U") for b in (8, 16, 32, 64)
]

DUPLICATE_KEY = ("user_id", "item_id", "slot", "event_ts")  # one impression
_SAMPLE = 5  # unexpected values shown per failure
_MAX_STR = 40  # characters kept of any observed string (an id may be 10,000 characters long)


def _type_expectation(col: schema.Column) -> gxe.Expectation:
    t = col.arrow_type
    if pa.types.is_string(t):
        return gxe.ExpectColumnValuesToBeOfType(column=col.name, type_="str", meta={"expected": "string dtype"})
    if pa.types.is_integer(t):
        return gxe.ExpectColumnValuesToBeInTypeList(
            column=col.name, type_list=_INT_TYPES, meta={"expected": "integer dtype"}
        )
    if pa.types.is_timestamp(t):
        return gxe.ExpectColumnValuesToBeOfType(
            column=col.name, type_="Timestamp", meta={"expected": "tz-aware datetime dtype"}
        )
    raise TypeError(f"no type expectation for contract column {col.name!r} of type {t}")


def _domain_rules(slots: list[str]) -> dict[str, gxe.Expectation]:
    """The value-domain check of each column that has one, keyed by column name."""
    # Domain rules are per column name; fail loudly if the contract renames one of them.
    domains: dict[str, gxe.Expectation] = {
        "label": gxe.ExpectColumnValuesToBeInSet(column="label", value_set=[0, 1], meta={"expected": "in [0, 1]"}),
        "slot": gxe.ExpectColumnValuesToBeInSet(column="slot", value_set=slots, meta={"expected": f"in {slots}"}),
        "hour": gxe.ExpectColumnValuesToBeBetween(
            column="hour", min_value=0, max_value=23, meta={"expected": "between 0 and 23"}
        ),
        "weekday": gxe.ExpectColumnValuesToBeBetween(
            column="weekday", min_value=0, max_value=6, meta={"expected": "between 0 and 6"}
        ),
    }
    unknown = set(domains) - set(schema.REQUIRED)
    if unknown:
        raise ValueError(f"validation rules name columns not in the contract: {sorted(unknown)}")
    return domains


def _column_expectations(cfg: ValidationConfig, domains: dict[str, gxe.Expectation]) -> list[gxe.Expectation]:
    """One group per required contract column: present, typed, nulls, id length, value domain."""
    exps: list[gxe.Expectation] = []
    for col in (c for c in schema.COLUMNS if c.required):
        exps.append(gxe.ExpectColumnToExist(column=col.name, meta={"expected": "column present"}))
        exps.append(_type_expectation(col))
        if col.nullable:
            exps.append(
                gxe.ExpectColumnValuesToNotBeNull(
                    column=col.name,
                    mostly=1.0 - cfg.max_null_fraction_side,
                    meta={"expected": f"null fraction <= {cfg.max_null_fraction_side}"},
                )
            )
        else:
            exps.append(gxe.ExpectColumnValuesToNotBeNull(column=col.name, meta={"expected": "no nulls"}))
        if col.role == "id":
            exps.append(
                gxe.ExpectColumnValueLengthsToBeBetween(
                    column=col.name,
                    min_value=1,
                    max_value=cfg.max_id_length,
                    meta={"expected": f"length 1..{cfg.max_id_length}"},
                )
            )
        if col.name in domains:
            exps.append(domains[col.name])
    return exps


def _partition_expectations(cfg: ValidationConfig) -> list[gxe.Expectation]:
    """The absolute label-rate band, event times inside the partition's day and not in the future, duplicates."""
    return [
        gxe.ExpectColumnMeanToBeBetween(
            column="label",
            min_value=cfg.label_rate_min,
            max_value=cfg.label_rate_max,
            meta={"expected": f"label rate in [{cfg.label_rate_min}, {cfg.label_rate_max}]", "label_rate_of": "all"},
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="event_ts",
            min_value={"$PARAMETER": "day_start"},
            max_value={"$PARAMETER": "day_end"},
            meta={"check": "event_ts_in_partition_day", "expected": "every event_ts inside the partition's UTC day"},
        ),
        gxe.ExpectColumnMaxToBeBetween(
            column="event_ts",
            max_value={"$PARAMETER": "now"},
            meta={"check": "no_future_event_ts", "expected": "max(event_ts) <= now"},
        ),
        gxe.ExpectCompoundColumnsToBeUnique(
            column_list=list(DUPLICATE_KEY),
            mostly=1.0 - cfg.max_duplicate_fraction,
            meta={
                "check": "duplicate_impressions",
                "expected": f"rows sharing {'/'.join(DUPLICATE_KEY)} <= {cfg.max_duplicate_fraction:.2%}",
            },
        ),
    ]


def _reference_expectations(cfg: ValidationConfig, slots: list[str]) -> list[gxe.Expectation]:
    """Checks relative to the reference window: volume, and the label rate overall and per slot."""
    exps: list[gxe.Expectation] = [
        gxe.ExpectTableRowCountToBeBetween(
            min_value={"$PARAMETER": "volume_min"},
            max_value={"$PARAMETER": "volume_max"},
            meta={
                "check": "volume_vs_reference",
                "relative": True,
                "expected": f"rows within [{cfg.volume_ratio_min}, "
                f"{cfg.volume_ratio_max}] x the reference's mean rows per partition",
            },
        )
    ]
    for group in ["all", *slots]:
        cond = {} if group == "all" else {"row_condition": f"slot=={group!r}", "condition_parser": "pandas"}
        exps.append(
            gxe.ExpectColumnMeanToBeBetween(
                column="label",
                min_value={"$PARAMETER": f"label_rate_min__{group}"},
                max_value={"$PARAMETER": f"label_rate_max__{group}"},
                **cond,
                meta={
                    "check": f"label_rate_vs_reference({group})",
                    "label_rate_of": group,
                    "relative": True,
                    "expected": f"within +/-{cfg.label_rate_rel_tolerance:.0%} (+{cfg.label_rate_z:g} std. errors) "
                    f"of the reference label rate",
                },
            )
        )
    return exps


def build_suite(cfg: ValidationConfig, slots: Sequence[str], with_reference: bool = False) -> gx.ExpectationSuite:
    """The suite for `cfg` and `slots`: table checks, then one group per required contract column,
    then the partition-date checks and, `with_reference`, the checks relative to the reference window.

    Values known only at run time come in as GX expectation parameters (see `_parameters`): the
    columns present, the partition's day bounds, now, and the reference-derived bands.
    """
    slots = list(slots)
    if not slots:
        raise ValueError("build_suite needs at least one slot")
    domains = _domain_rules(slots)
    exps: list[gxe.Expectation] = [
        gxe.ExpectTableRowCountToBeBetween(
            min_value=cfg.min_rows, max_value=None, meta={"expected": f">= {cfg.min_rows} rows"}
        ),
        gxe.ExpectTableColumnsToMatchSet(
            column_set={"$PARAMETER": _COLUMNS_PARAM},
            exact_match=True,
            meta={"expected": "no columns outside the contract"},
        ),
    ]
    exps += _column_expectations(cfg, domains)
    exps += _partition_expectations(cfg)
    if with_reference:
        exps += _reference_expectations(cfg, slots)
    return gx.ExpectationSuite(name=SUITE_NAME, expectations=exps)


def _parameters(
    frame: pd.DataFrame, cfg: ValidationConfig, slots: Sequence[str], day: str | None, reference: dict | None
) -> dict:
    """Run-time values of the suite's parameters."""
    if day is None:  # a bare directory: judge against the day most of its rows fall on
        ts = pd.to_datetime(frame["event_ts"], utc=True, errors="coerce") if "event_ts" in frame else pd.Series([])
        day = ts.dt.strftime("%Y-%m-%d").mode().iloc[0] if ts.notna().any() else "1970-01-01"
    start = pd.Timestamp(day, tz="UTC")
    params = {
        _COLUMNS_PARAM: [c for c in frame.columns if c in schema.ALL_NAMES],
        "day_start": start,
        "day_end": start + pd.Timedelta(days=1) - pd.Timedelta(microseconds=1),
        "now": pd.Timestamp.now(tz="UTC"),
    }
    if reference is not None:
        per_partition = reference["rows"] / max(reference["partitions"], 1)
        params["volume_min"] = math.floor(per_partition * cfg.volume_ratio_min)
        params["volume_max"] = math.ceil(per_partition * cfg.volume_ratio_max)
        tol, z = cfg.label_rate_rel_tolerance, cfg.label_rate_z
        rows = frame["slot"].value_counts().to_dict() if "slot" in frame else {}
        for group in ["all", *slots]:
            rate = reference["label_rate"] if group == "all" else reference["label_rate_by_slot"].get(group)
            ref_rows = reference["rows"] if group == "all" else reference.get("rows_by_slot", {}).get(group, 0)
            if ref_rows < cfg.label_rate_min_rows:  # a rate from a handful of reference rows is no yardstick
                rate = None
            n = len(frame) if group == "all" else rows.get(group, 0)
            if rate is None or n == 0:
                lo, hi = 0.0, 1.0
            else:
                # Relative band, widened by z binomial standard errors at this partition's row count:
                # a 1.5% CTR slot with 2,000 rows has ~18% relative noise on its own.
                se = math.sqrt(rate * (1 - rate) / n)
                lo, hi = max(0.0, rate * (1 - tol) - z * se), min(1.0, rate * (1 + tol) + z * se)
            params[f"label_rate_min__{group}"], params[f"label_rate_max__{group}"] = lo, hi
    return params


@functools.lru_cache(maxsize=None)
def _cached_suite(cfg: ValidationConfig, slots: tuple[str, ...], with_reference: bool) -> gx.ExpectationSuite:
    return build_suite(cfg, slots, with_reference)


def suite_version(cfg: ValidationConfig, slots: Sequence[str]) -> str:
    """Changes whenever the checks change: a partition validated under another version is re-validated."""
    return f"{SUITE_NAME}@{gx.__version__}:{config_hash(cfg)[:12]}:{','.join(slots)}"


@functools.lru_cache(maxsize=1)
def _batch_definition():
    """One ephemeral context per process: creating it costs far more than a validation."""
    ctx = gx.get_context(mode="ephemeral")
    _quiet_gx_logs()  # the context import-loads more GX modules
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    asset = ctx.data_sources.add_pandas("click_log").add_dataframe_asset("frame")
    return asset.add_batch_definition_whole_dataframe("whole_frame")


def _short(v: Any) -> Any:
    """A small JSON-safe rendering of an observed value."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, bool | int):
        return v
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    if isinstance(v, str):
        return v if len(v) <= _MAX_STR else f"{v[:_MAX_STR]}...({len(v)} chars)"
    if isinstance(v, dict):
        return {str(k): _short(x) for k, x in list(v.items())[: _SAMPLE * 2]}
    if isinstance(v, list | tuple | set):
        return [_short(x) for x in list(v)[:_SAMPLE]]
    return _short(str(v))


def _error(er) -> str | None:
    """The first exception message GX caught for this expectation (flat or keyed by metric id)."""
    info = er.exception_info or {}
    infos = [info] if "raised_exception" in info else [i for i in info.values() if isinstance(i, dict)]
    return next((str(i.get("exception_message")) for i in infos if i.get("raised_exception")), None)


def _observed(er, columns: set) -> Any:
    kind, kwargs = er.expectation_config.type, er.expectation_config.kwargs
    res = er.result or {}
    if "column" in kwargs and kwargs["column"] not in columns:
        # GX reports a missing column as a metric error in every expectation on it; say it plainly.
        return f"missing column {kwargs['column']}"
    err = _error(er)
    if err is not None:
        return f"error: {_short(err)}"
    if kind == "expect_table_columns_to_match_set":
        return _short((res.get("details") or {}).get("mismatched", res.get("observed_value")))
    if "unexpected_count" in res:
        return {
            "unexpected_count": _short(res["unexpected_count"]),
            "unexpected_percent": _short(res.get("unexpected_percent")),
            "sample": _short(res.get("partial_unexpected_list") or []),
        }
    return _short(res.get("observed_value"))


def _bounds(kwargs: dict, params: dict) -> str:
    """The run-time bounds of a parameterised check, e.g. ' = [0.1025, 0.7150]', for the message."""
    lo, hi = kwargs.get("min_value"), kwargs.get("max_value")
    if isinstance(lo, dict) or isinstance(hi, dict):  # not yet substituted by GX
        lo, hi = (params.get(b["$PARAMETER"]) if isinstance(b, dict) else b for b in (lo, hi))
    return f" = [{_short(lo)}, {_short(hi)}]"


def _check_name(config) -> str:
    """e.g. expect_column_values_to_be_in_set(slot), or the explicit meta name of a derived check."""
    return (config.meta or {}).get("check") or f"{config.type}({config.kwargs.get('column') or 'table'})"


def validate_frame(
    frame: pd.DataFrame,
    cfg: ValidationConfig,
    slots: Sequence[str],
    where: str = "frame",
    day: str | None = None,
    reference: dict | None = None,
) -> dict:
    """Validate `frame` against the contract suite; return a JSON-safe report (never raises on bad data).

    `day` is the partition's date (default: the date most rows fall on); `reference` holds the
    reference window's stats (see stage.reference_stats) and enables the relative checks.
    """
    suite = _cached_suite(cfg, tuple(slots), reference is not None)
    batch = _batch_definition().get_batch(batch_parameters={"dataframe": frame})
    params = _parameters(frame, cfg, slots, day, reference)
    result = batch.validate(
        suite,
        result_format={"result_format": "BASIC", "partial_unexpected_count": _SAMPLE},
        expectation_parameters=params,
    )
    # GX returns results in its own metric-graph order; report them in suite order (table, then columns).
    order = {_check_name(e.configuration): i for i, e in enumerate(suite.expectations)}
    failed = sorted(
        (r for r in result.results if not r.success),
        key=lambda r: order.get(_check_name(r.expectation_config), len(order)),
    )
    columns = set(frame.columns)
    failures, warnings = [], []
    group_rows = frame["slot"].value_counts().to_dict() if "slot" in columns else {}
    for r in failed:
        meta = r.expectation_config.meta or {}
        entry = {
            "check": _check_name(r.expectation_config),
            "observed": _observed(r, columns),
            "expected": meta.get("expected", "")
            + (_bounds(r.expectation_config.kwargs, params) if meta.get("relative") else ""),
        }
        # A label rate measured on a handful of rows says nothing (one MovieLens day has a single
        # impression): below label_rate_min_rows it is a warning, recorded but not failing.
        group = meta.get("label_rate_of")
        rows = len(frame) if group == "all" else group_rows.get(group, 0)
        soft = (group is not None and rows < cfg.label_rate_min_rows) or (
            entry["check"].startswith("expect_table_columns_to_match_set") and cfg.unexpected_columns == "warn"
        )
        (warnings if soft else failures).append(entry)
    return {
        "where": where,
        "success": not failures,
        "rows": int(len(frame)),
        "suite": SUITE_NAME,
        "gx_version": gx.__version__,
        "evaluated": len(result.results),
        "failures": failures,
        "warnings": warnings,
    }
