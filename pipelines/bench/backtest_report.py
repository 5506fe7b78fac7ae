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

from pipelines.bench.backtest import COMPARATORS, table

EXPERIMENT = "ctr-backtest"


def _plot(result: dict, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")   # headless; must precede the pyplot import
    import matplotlib.pyplot as plt
    import pandas as pd

    days = pd.DataFrame(result["per_day"])
    x = pd.to_datetime(days["date"])
    names = [n for n in COMPARATORS if n in days]
    fig, (cum, daily) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for n in names:
        cum.plot(x, days[f"cum_{n}"], label=f"{n} ({result[f'{n}_auc']})")
        daily.plot(x, days[n].rolling(7, min_periods=1).mean(), label=n)
    cum.set(title=f"Backtest {result['from']}..{result['to']}: AUC of every row scored so far", ylabel="AUC")
    cum.legend(fontsize="small")
    daily.set(title="Each day's AUC, 7-day rolling mean", ylabel="AUC", xlabel="scored day")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _page(result: dict, image: str) -> str:
    names = [n for n in COMPARATORS if f"{n}_auc" in result]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("day", "rows", "warm rows", *names))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(d.get(k)))}</td>"
                                    for k in ("date", "rows", "warm_rows", *names)) + "</tr>"
                   for d in result["per_day"])
    summary = html.escape(table(result))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Backtest</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>\n"
            f"<h1>Backtest {html.escape(result['from'])}..{html.escape(result['to'])}</h1>\n<pre>{summary}</pre>\n"
            f"<img src=\"{html.escape(Path(image).name)}\" alt=\"AUC over time\">\n"
            f"<h2>Each day's AUC</h2>\n<table><tr>{head}</tr>{body}</table>\n</body></html>\n")


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
    import mlflow

    from pipelines.registry import mlflow_io

    metrics = {k: float(v) for k, v in result.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
    with mlflow.start_run(experiment_id=mlflow_io.ensure_experiment(EXPERIMENT),
                          run_name=f"backtest-{result['from']}-{result['to']}") as run:
        mlflow.set_tags({"stage": "backtest", "data.from": result["from"], "data.to": result["to"],
                         "code.version": mlflow_io.code_version()})
        mlflow.log_metrics(metrics)
        for step, day in enumerate(result["per_day"], start=1):
            mlflow.log_metrics({f"cum_{n}_auc": day[f"cum_{n}"] for n in COMPARATORS
                                if day.get(f"cum_{n}") is not None}, step=step)
        for path in files.values():
            mlflow.log_artifact(path, artifact_path="backtest")
    return run.info.run_id
