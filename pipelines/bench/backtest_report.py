"""The backtest as a picture and a page: AUC over time per comparator, and the result logged to MLflow.

`write(result, out_dir)` writes auc_over_time.png (cumulative AUC: every scored row up to the day; and
each day's own AUC, a 7-day rolling mean, since single days are small), backtest.html (the summary
table, the picture, a row per day) and backtest.json. `log_to_mlflow(result, out_dir)` makes one run
in the `ctr-backtest` experiment: the summary figures as metrics, the cumulative AUC per day as a
metric history (step = day number), and the three files as artifacts.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from matplotlib.figure import Figure
import mlflow
import pandas as pd

from pipelines.bench.backtest import COMPARATORS, table
from pipelines.bench.backtest_protocol import EXPERIMENT
from pipelines.registry import mlflow_io


def _plot(result: dict, path: Path) -> str:
    days = pd.DataFrame(result["per_day"])
    x = pd.to_datetime(days["date"])
    names = [n for n in COMPARATORS if n in days]
    fig = Figure(figsize=(10, 8))  # not through pyplot: no backend to choose, nothing to close
    cum, daily = fig.subplots(2, 1, sharex=True)
    for n in names:
        cum.plot(x, days[f"cum_{n}"], label=f"{n} ({result[f'{n}_auc']})")
        daily.plot(x, days[n].rolling(7, min_periods=1).mean(), label=n)
    _mark_decisions(daily, result, x)
    cum.set(title=f"Backtest {result['from']}..{result['to']}: AUC of every row scored so far", ylabel="AUC")
    cum.legend(fontsize="small")
    daily.set(title="Each day's AUC, 7-day rolling mean", ylabel="AUC", xlabel="scored day")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


# served's decisions on the daily panel: what happened on the evening of the day (it serves from the next)
_MARKS = {
    "release": ("^", "tab:green", "gate: released"),
    "reject": ("v", "tab:gray", "gate: rejected"),
    "held": ("o", "tab:olive", "gate: passed, held (a canary is watched)"),
    "promote": ("*", "tab:blue", "canary promoted"),
    "withdraw": ("x", "tab:orange", "canary withdrawn"),
    "revert": ("X", "tab:red", "reverted"),
    "invalid": ("s", "black", "day failed validation"),
}


def decisions(result: dict) -> list[tuple[str, str, str]]:
    """(date, kind, what) for every decision of the `served` replay, kinds as in _MARKS."""
    out = []
    for d in ((result.get("comparators") or {}).get("served") or {}).get("days", []):
        if not d.get("validated", True):
            out.append((d["date"], "invalid", "validation failed"))
        for slot, g in sorted(d.get("gate", {}).items()):
            if "passed" in g:
                kind = "release" if g["released"] else "held" if g.get("held") else "reject"
                to = f" -> @{g['alias']}" if g["released"] else ""
                out.append((d["date"], kind, f"{slot} v{g['version']}{to}"))
        for m in d.get("monitor", {}).get("moves", []):
            if m["kind"] in ("promote", "withdraw"):
                out.append((d["date"], m["kind"], f"{m['model']} v{m['to_version'] or ''}".rstrip()))
        out += [
            (d["date"], "revert", f"{r['model']} -> v{r['to_version']}")
            for r in d.get("monitor", {}).get("reverts", [])
        ]
    return out


def _mark_decisions(ax, result: dict, x) -> None:
    marks = decisions(result)
    if not marks:
        return
    low, high = ax.get_ylim()
    step = (high - low) * 0.03  # a row per kind at the bottom, so a day's decisions do not hide each other
    kinds = [k for k in _MARKS if any(m[1] == k for m in marks)]
    ax.set_ylim(low - step * (len(kinds) + 1), high)
    for row, kind in enumerate(kinds, start=1):
        marker, color, label = _MARKS[kind]
        dates = sorted({d for d, k, _ in marks if k == kind})
        n = [sum(1 for d2, k, _ in marks if k == kind and d2 == d) for d in dates]  # bigger: several slots
        ax.scatter(
            pd.to_datetime(dates),
            [low - step * row] * len(dates),
            marker=marker,
            color=color,
            s=[30 + 15 * c for c in n],
            label=label,
            zorder=3,
        )
    ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))  # below: clear of the marks


def _page(result: dict, image: str) -> str:
    names = [n for n in COMPARATORS if f"{n}_auc" in result]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("day", "rows", "warm rows", *names))
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(str(d.get(k)))}</td>" for k in ("date", "rows", "warm_rows", *names))
        + "</tr>"
        for d in result["per_day"]
    )
    summary = html.escape(table(result))
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Backtest</title><style>'
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>\n"
        f"<h1>Backtest {html.escape(result['from'])}..{html.escape(result['to'])}</h1>\n<pre>{summary}</pre>\n"
        f'<img src="{html.escape(Path(image).name)}" alt="AUC over time">\n'
        f"<h2>Each day's AUC</h2>\n<table><tr>{head}</tr>{body}</table>\n{_decision_table(result)}</body></html>\n"
    )


def _decision_table(result: dict) -> str:
    marks = decisions(result)
    if not marks:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(d)}</td><td>{html.escape(_MARKS[k][2])}</td><td>{html.escape(w)}</td></tr>"
        for d, k, w in marks
    )
    return (
        "<h2>What the pipeline decided (served)</h2>\n<p>Each evening, after the day's rows landed; the "
        "change serves from the next morning.</p>\n"
        f"<table><tr><th>day</th><th>decision</th><th>what</th></tr>{rows}</table>\n"
    )


def write(result: dict, out_dir) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    image = _plot(result, out / "auc_over_time.png")
    page = out / "backtest.html"
    page.write_text(_page(result, image), encoding="utf-8")
    data = out / "backtest.json"
    data.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return {"html": str(page), "image": image, "json": str(data)}


def log_to_mlflow(result: dict, files: dict) -> str:
    """One MLflow run holding the backtest (tracking URI from the environment); returns its run id."""
    metrics = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None
    }
    with mlflow.start_run(
        experiment_id=mlflow_io.ensure_experiment(EXPERIMENT), run_name=f"backtest-{result['from']}-{result['to']}"
    ) as run:
        mlflow.set_tags(
            {
                "stage": "backtest",
                "data.from": result["from"],
                "data.to": result["to"],
                "code.version": mlflow_io.code_version(),
            }
        )
        mlflow.log_metrics(metrics)
        for step, day in enumerate(result["per_day"], start=1):
            mlflow.log_metrics(
                {f"cum_{n}_auc": day[f"cum_{n}"] for n in COMPARATORS if day.get(f"cum_{n}") is not None}, step=step
            )
        for path in files.values():
            mlflow.log_artifact(path, artifact_path="backtest")
    return run.info.run_id
