"""Every scored row of a backtest, kept (`backtest --scores FILE`), and two such files compared row by row
(`python -m pipelines backtest-compare A B`).

A family's AUC on a small part of the test days (MovieLens' 202 new-item rows) moves by a few hundredths from
one model to the next by chance alone, so "family A beats family B there by 0.01" cannot be read off two
AUCs. Both backtests score the same rows, so the difference is measured *paired*: DeLong's test
(`evaluation.delong`) on the two score vectors over the same labels, with its 95% interval, for all rows and
for the warm, cold and new-item ones. Against a goal margin (`--margin`) the verdict is `met` when the whole
interval is at or above it, `missed` when the whole interval is below it, and `undecided` otherwise.
Beside it, the rows the part would need for an interval of ±margin at the variance seen: with fewer, an
interval that holds 0 also holds the margin, so no run of that size can tell "no better" from "better by
the margin".
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from matplotlib.figure import Figure
import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.bench.backtest_protocol import EXPERIMENT, Backtest
from pipelines.errors import ConfigError
from pipelines.evaluation.delong import delong_test
from pipelines.metrics import EvaluationInputError
from pipelines.registry import mlflow_io

KEYS = ("date", "slot", "user_id", "item_id", "label")  # what identifies a scored row in both files
_META = b"ctr_backtest"


def frame(bt: Backtest, preds: dict[str, np.ndarray]) -> pd.DataFrame:
    """One row per scored row: its keys, warm / new_item, and `score_<comparator>` for each comparator."""
    scored = bt.frame.iloc[bt.first : bt.last]
    out = pd.DataFrame(
        {
            "date": bt.dates[bt.first : bt.last].astype(str),
            "slot": scored["slot"].astype(str).to_numpy(),
            "user_id": scored["user_id"].astype(str).to_numpy(),
            "item_id": scored["item_id"].astype(str).to_numpy(),
            "label": bt.labels(),
            "warm": bt.warm[bt.first : bt.last],
            "new_item": bt.new_item[bt.first : bt.last],
        }
    )
    for name, p in preds.items():
        out[f"score_{name}"] = np.asarray(p, dtype=np.float64)
    return out


def write(path: str, bt: Backtest, preds: dict[str, np.ndarray], meta: dict) -> str:
    """`frame` as parquet at `path`, `meta` (the family, first and last day) in its schema metadata; returns
    the path."""
    table = pa.Table.from_pandas(frame(bt, preds), preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META: json.dumps(meta).encode()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def read(path: str) -> tuple[pd.DataFrame, dict]:
    """(rows, meta) of a `write` file; a file that is not one is a ConfigError naming it."""
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"backtest-compare: cannot read {path}: {e}") from e
    raw = (table.schema.metadata or {}).get(_META)
    missing = [c for c in (*KEYS, "warm", "new_item") if c not in table.column_names]
    if raw is None or missing:
        raise ConfigError(
            f"backtest-compare: {path} is not a `backtest --scores` file (missing {missing or 'its metadata'})"
        )
    return table.to_pandas(), json.loads(raw)


def _scores(rows: pd.DataFrame, comparator: str, path: str) -> np.ndarray:
    col = f"score_{comparator}"
    if col not in rows.columns:
        have = [c.removeprefix("score_") for c in rows.columns if c.startswith("score_")]
        raise ConfigError(f"backtest-compare: {path} has no scores of {comparator!r}; it has {have}")
    return rows[col].to_numpy()


def compare(
    a: str, b: str, comparator_a: str = "static", comparator_b: str = "static", margin: float | None = None
) -> dict:
    """AUC(a) - AUC(b) on the rows both files scored, paired, per part (see the module docstring)."""
    rows_a, meta_a = read(a)
    rows_b, meta_b = read(b)
    if len(rows_a) != len(rows_b) or not rows_a[list(KEYS)].equals(rows_b[list(KEYS)]):
        raise ConfigError(
            f"backtest-compare: {a} and {b} did not score the same rows (same days, same log): "
            f"{len(rows_a)} against {len(rows_b)} rows"
        )
    protocol_a, protocol_b = _protocol(meta_a), _protocol(meta_b)
    if protocol_a != protocol_b:
        raise ConfigError(
            f"backtest-compare: {a} is of the {protocol_a} protocol and {b} of the {protocol_b} one: "
            "the same rows, scored by models that saw different things"
        )
    pa_, pb = _scores(rows_a, comparator_a, a), _scores(rows_b, comparator_b, b)
    y = rows_a["label"].to_numpy()
    masks = {
        "all": np.ones(len(y), dtype=bool),
        "warm": rows_a["warm"].to_numpy(dtype=bool),
        "cold": ~rows_a["warm"].to_numpy(dtype=bool),
        "new_item": rows_a["new_item"].to_numpy(dtype=bool),
    }
    return {
        "a": {"file": str(a), "comparator": comparator_a, "model_family": meta_a.get("model_family")},
        "b": {"file": str(b), "comparator": comparator_b, "model_family": meta_b.get("model_family")},
        "protocol": protocol_a,
        "from": rows_a["date"].iloc[0],
        "to": rows_a["date"].iloc[-1],
        "margin": margin,
        "parts": {name: part(y[m], pa_[m], pb[m], margin) for name, m in masks.items()},
    }


def _protocol(meta: dict) -> str:
    """How the file's rows were scored: `replay` (the daily replay; files written before the key existed
    are its) or `cold_items` with its fold count (`backtest_cold_items`)."""
    protocol = meta.get("protocol", "replay")
    return f"{protocol} ({meta['folds']} folds)" if "folds" in meta else protocol


def part(y: np.ndarray, p_a: np.ndarray, p_b: np.ndarray, margin: float | None) -> dict:
    """One part's paired difference; a part DeLong cannot measure (one class, too few rows) says why."""
    out: dict = {"rows": int(len(y)), "positives": int(y.sum())}
    try:
        t = delong_test(y, p_a, p_b)
    except EvaluationInputError as e:
        return {**out, "error": str(e)}
    out.update(
        auc_a=round(t["auc_a"], 4),
        auc_b=round(t["auc_b"], 4),
        diff=round(t["diff"], 4),
        se=round(t["se"], 4),
        ci95=[round(v, 4) for v in t["ci95"]],
        p_value=round(t["p_value"], 4),
    )
    if margin is not None:
        out.update(verdict=verdict(t["ci95"], margin), rows_for_decision=rows_for_halfwidth(len(y), t["se"], margin))
    return out


def verdict(ci95: list[float], margin: float) -> str:
    """`met` when the interval lies at or above `margin`, `missed` when it lies below it, else `undecided`. Pure."""
    low, high = ci95
    return "met" if low >= margin else "missed" if high < margin else "undecided"


def rows_for_halfwidth(rows: int, se: float, halfwidth: float) -> int | None:
    """Rows for a 95% interval of ±`halfwidth` at the variance seen on `rows` (se shrinks as 1/sqrt(rows)). Pure."""
    if se <= 0 or halfwidth <= 0:
        return None
    return int(math.ceil(rows * (1.959964 * se / halfwidth) ** 2))


def table(r: dict) -> str:
    """The comparison as a markdown table (the CLI's output without --json)."""
    a, b = r["a"], r["b"]
    lines = [
        f"backtest-compare {r['from']}..{r['to']} ({r.get('protocol', 'replay')}): "
        f"A = {a['model_family']} {a['comparator']}, "
        f"B = {b['model_family']} {b['comparator']} (paired DeLong, 95% interval"
        + (f"; goal A - B >= {r['margin']})" if r["margin"] is not None else ")"),
        "",
        "| rows | n | positives | AUC A | AUC B | A - B | 95% interval | p | verdict | rows for a decision |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in r["parts"].items():
        if "error" in p:
            lines.append(f"| {name} | {p['rows']} | {p['positives']} | - | - | - | {p['error']} | - | - | - |")
            continue
        lines.append(
            f"| {name} | {p['rows']} | {p['positives']} | {p['auc_a']} | {p['auc_b']} | {p['diff']:+.4f} | "
            f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] | {p['p_value'] or '< 0.0001'} | "
            f"{p.get('verdict', '-')} | {p.get('rows_for_decision') or '-'} |"
        )
    return "\n".join(lines)


def figure(r: dict, path) -> str:
    """A forest plot: A - B per part with its 95% interval, the zero line and the goal's margin."""
    parts = [(n, p) for n, p in r["parts"].items() if "diff" in p]
    fig = Figure(figsize=(10, 1.4 + 0.6 * len(parts)))  # not through pyplot: no backend to choose, nothing to close
    ax = fig.subplots()
    for y, (name, p) in enumerate(reversed(parts)):
        low, high = p["ci95"]
        ax.errorbar(p["diff"], y, xerr=[[p["diff"] - low], [high - p["diff"]]], fmt="o", capsize=4, color="tab:blue")
        ax.annotate(
            f"{p['diff']:+.4f} [{low:+.4f}, {high:+.4f}], {p['rows']} rows",
            (1.02, y),
            xycoords=("axes fraction", "data"),
            va="center",
            fontsize="small",
        )
    ax.axvline(0.0, color="gray", linewidth=1)
    if r["margin"] is not None:
        ax.axvline(r["margin"], color="tab:red", linestyle="--", linewidth=1, label=f"goal: A - B >= {r['margin']}")
        ax.legend(fontsize="small", loc="lower left")
    ax.set_yticks(range(len(parts)), [n for n, _ in reversed(parts)])
    ax.set_ylim(-0.7, len(parts) - 0.3)
    a, b = r["a"], r["b"]
    ax.set(
        xlabel="AUC difference A - B (paired DeLong, 95% interval)",
        title=f"A = {a['model_family']} {a['comparator']}, B = {b['model_family']} {b['comparator']}\n"
        f"{r['from']}..{r['to']}, {r.get('protocol', 'replay')}",
    )
    ax.margins(x=0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


def log_to_mlflow(r: dict) -> str:
    """One run in the backtest's experiment: each part's difference and interval as metrics, the forest
    plot and the result as artifacts (tracking URI from the environment); returns its run id."""
    metrics = {
        f"{k}_{name}": float(v)
        for name, p in r["parts"].items()
        if "diff" in p
        for k, v in (
            ("auc_a", p["auc_a"]),
            ("auc_b", p["auc_b"]),
            ("diff", p["diff"]),
            ("ci95_low", p["ci95"][0]),
            ("ci95_high", p["ci95"][1]),
            ("p_value", p["p_value"]),
        )
    }
    a, b = r["a"], r["b"]
    with (
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(
            experiment_id=mlflow_io.ensure_experiment(EXPERIMENT),
            run_name=f"compare-{a['model_family']}-{a['comparator']}-vs-{b['model_family']}-{b['comparator']}",
        ) as run,
    ):
        mlflow.set_tags(
            {
                "stage": "backtest-compare",
                "a.family": a["model_family"],
                "a.comparator": a["comparator"],
                "b.family": b["model_family"],
                "b.comparator": b["comparator"],
                "data.from": r["from"],
                "data.to": r["to"],
                "protocol": r.get("protocol", "replay"),
                "code.version": mlflow_io.code_version(),
            }
        )
        mlflow.log_metrics(metrics)
        if r["margin"] is not None:
            mlflow.log_param("margin", r["margin"])
            mlflow.set_tags({f"verdict.{n}": p["verdict"] for n, p in r["parts"].items() if "verdict" in p})
        mlflow.log_artifact(figure(r, Path(tmp) / "compare.png"), artifact_path="compare")
        mlflow.log_dict(r, "compare/compare.json")
    return run.info.run_id
