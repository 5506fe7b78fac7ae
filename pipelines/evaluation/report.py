"""Human-readable output of a compare_predictions() result: PNG plots plus one HTML page, and a
fixed-width text table for the task log. Both read the same table sections, so the log and the
page never disagree.

Plots need no raw data except the ROC curves: pass the labels and the scores to write_report for
them (without them the ROC plot is skipped, its path None). The plots are drawn on matplotlib
Figures, never through pyplot: no backend is chosen, so they draw on headless workers.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from matplotlib.figure import Figure
import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

from pipelines.metrics import check_result

_OVERALL_KEYS = ("auc", "logloss", "ne", "calibration_ratio", "ece", "ctr", "mean_pctr", "rows")
_WHO = ("candidate", "champion")


# ----------------------------------------------------------------------------- table sections
def fmt(v) -> str:
    """One cell: '-' for missing, integers as is, small floats in e-notation (p-values, ECE)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.2e}" if v != 0.0 and abs(v) < 1e-3 else f"{v:.4f}"
    return str(v)


def _delta(a, b):
    return a - b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


def _get(d: dict | None, *path):
    for k in path:
        if d is None:
            return None
        d = d.get(k)
    return d


def _overall(c: dict) -> tuple[str, list[str], list[list]]:
    cand, champ = c["candidate"], c.get("champion")
    rows = [
        [k, cand["overall"][k], _get(champ, "overall", k), _delta(cand["overall"][k], _get(champ, "overall", k))]
        for k in _OVERALL_KEYS
    ]
    g_c, g_h = cand["gauc"]["gauc"], _get(champ, "gauc", "gauc")
    rows.append(["gauc", g_c, g_h, _delta(g_c, g_h)])
    rows.append(["gauc_users_used", cand["gauc"]["users_used"], _get(champ, "gauc", "users_used"), None])
    return "Overall", ["metric", "candidate", "champion", "delta"], rows


def _delong(c: dict) -> tuple[str, list[str], list[list]]:
    d = c.get("delong")
    if d is None:
        return "DeLong test (candidate - champion)", ["note"], [[c.get("delong_skipped") or "not run"]]
    return (
        "DeLong test (candidate - champion)",
        ["auc_cand", "auc_champ", "diff", "se", "ci95_low", "ci95_high", "z", "p_value", "n_pos", "n_neg"],
        [
            [
                d["auc_a"],
                d["auc_b"],
                d["diff"],
                d["se"],
                d["ci95"][0],
                d["ci95"][1],
                d["z"],
                d["p_value"],
                d["n_pos"],
                d["n_neg"],
            ]
        ],
    )


def _slots(c: dict) -> tuple[str, list[str], list[list]]:
    cand, champ = c["candidate"], c.get("champion")
    rows = []
    for slot, s in cand["slots"].items():
        h = _get(champ, "slots", slot)
        rows.append(
            [
                slot,
                s["rows"],
                s["ctr"],
                s["auc"],
                _get(h, "auc"),
                _delta(s["auc"], _get(h, "auc")),
                s["logloss"],
                _get(h, "logloss"),
                s["skipped"] or "",
            ]
        )
    return (
        "Per slot",
        ["slot", "rows", "ctr", "auc_cand", "auc_champ", "delta", "logloss_cand", "logloss_champ", "note"],
        rows,
    )


def _cold_warm(c: dict) -> tuple[str, list[str], list[list]]:
    cand, champ = c["candidate"], c.get("champion")
    if cand.get("cold_warm") is None:
        return "Cold / warm", ["note"], [["no cold mask given"]]
    rows = []
    for part in ("cold", "warm"):
        s, h = cand["cold_warm"][part], _get(champ, "cold_warm", part)
        rows.append(
            [
                part,
                s["rows"],
                s["auc"],
                _get(h, "auc"),
                _delta(s["auc"], _get(h, "auc")),
                s["logloss"],
                _get(h, "logloss"),
                s["skipped"] or "",
            ]
        )
    return (
        "Cold / warm",
        ["rows_of", "rows", "auc_cand", "auc_champ", "delta", "logloss_cand", "logloss_champ", "note"],
        rows,
    )


def fairness_gaps(result: dict | None) -> dict[str, float | None]:
    """{"<column> <gap>": value} of one evaluate_predictions() result (the fairness bar chart's bars)."""
    out = {}
    for col, f in ((result or {}).get("fairness") or {}).items():
        out[f"{col} dp_pctr"] = f["demographic_parity"]["mean_pctr_gap"]
        out[f"{col} dp_rate"] = f["demographic_parity"]["positive_rate_gap"]
        out[f"{col} eq_odds"] = f["equalized_odds"]["equalized_odds_difference"]
    return out


def _fairness(c: dict) -> tuple[str, list[str], list[list]]:
    cand, champ = fairness_gaps(c["candidate"]), fairness_gaps(c.get("champion"))
    rows = [[k.split(" ")[0], k.split(" ")[1], v, champ.get(k), _delta(v, champ.get(k))] for k, v in cand.items()]
    title = f"Fairness gaps (max - min over groups; threshold {fmt(c.get('threshold'))}, {c.get('threshold_rule')})"
    return title, ["column", "gap", "candidate", "champion", "delta"], rows


def sections(comparison: dict) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, rows) for each table, raw values (format with fmt)."""
    return [f(comparison) for f in (_overall, _delong, _slots, _cold_warm, _fairness)]


def format_table(comparison: dict) -> str:
    """Compact fixed-width text of every section, for the task log."""
    out = []
    for title, header, rows in sections(comparison):
        cells = [header] + [[fmt(v) for v in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        out.append(f"== {title}")
        for r in cells:
            out.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)


# ----------------------------------------------------------------------------- plots
def _subplots(*, figsize: tuple[float, float]):
    """(figure, axes) outside pyplot: nothing global to choose (a backend) or to close afterwards."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)


def plot_gate(decision: dict, path: Path) -> str:
    """The gate decision as a picture: one row per check, green pass / red fail, value vs threshold."""
    checks = decision["checks"]
    rows = [[c["name"], fmt(c["value"]), fmt(c["threshold"]), check_result(c)] for c in checks]
    fig, ax = _subplots(figsize=(8, 0.3 * len(rows) + 0.9))
    ax.axis("off")
    table = ax.table(
        cellText=rows,
        colLabels=["check", "value", "threshold", "result"],
        bbox=[0, 0, 1, 1],
        cellLoc="left",
        colWidths=[0.45, 0.2, 0.2, 0.15],
    )
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    for i, c in enumerate(checks, start=1):
        table[i, 3].set_facecolor("#ffcdd2" if not c["passed"] else "#eeeeee" if c["value"] is None else "#c8e6c9")
    verdict = "PASSED" if decision["passed"] else "REJECTED"
    extra = " (first run: absolute thresholds)" if decision.get("first_run") else ""
    ax.set_title(f"{decision.get('model', '')} v{decision.get('version', '')}: gate {verdict}{extra}", fontsize=11)
    return _save(fig, Path(path))


def plot_roc(y, scores: dict[str, np.ndarray], path: Path) -> str | None:
    """ROC curve per named score vector; None when the labels hold a single class (no curve)."""
    y = np.asarray(y, dtype=np.float64).ravel()
    if len(y) == 0 or y.min() == y.max():
        return None
    fig, ax = _subplots(figsize=(5, 5))
    for name, p in scores.items():
        fpr, tpr, _ = roc_curve(y, p)
        ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(y, p):.4f})")
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey", label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC")
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_reliability(curves: dict[str, dict], path: Path) -> str:
    """Observed click rate against mean predicted CTR per bin (curves from reliability_curve)."""
    fig, ax = _subplots(figsize=(5, 5))
    top = 0.0
    for name, c in curves.items():
        ax.plot(c["mean_predicted"], c["observed_rate"], marker="o", label=name)
        top = max([top, *c["mean_predicted"], *c["observed_rate"]])
    top = top * 1.05 or 1.0  # zoom on where CTRs are: at 2 % CTR the [0, 1] square is empty
    ax.plot([0, top], [0, top], linestyle=":", color="grey", label="perfect calibration")
    strategy = next(iter(curves.values()))["strategy"] if curves else ""
    ax.set(
        xlim=(0, top),
        ylim=(0, top),
        xlabel="mean predicted CTR",
        ylabel="observed CTR",
        title=f"Reliability ({strategy} bins)",
    )
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_bars(values: dict[str, dict[str, float | None]], title: str, ylabel: str, path: Path) -> str:
    """Grouped bars: one group per category, one bar per series ({series: {category: value}})."""
    cats = list(dict.fromkeys(k for v in values.values() for k in v))
    fig, ax = _subplots(figsize=(max(5.0, 0.9 * len(cats) + 2), 4))
    x = np.arange(len(cats))
    width = 0.8 / max(len(values), 1)
    for i, (series, v) in enumerate(values.items()):
        heights = [np.nan if v.get(c) is None else v[c] for c in cats]  # NaN: no bar, not a 0 bar
        ax.bar(x + i * width - 0.4 + width / 2, heights, width, label=series)
    ax.set_xticks(x, cats, rotation=30 if len(cats) > 4 else 0, ha="right" if len(cats) > 4 else "center")
    ax.set(title=title, ylabel=ylabel)
    ax.legend()
    return _save(fig, path)


# ----------------------------------------------------------------------------- html
def _html_table(title: str, header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<h2>{html.escape(title)}</h2>\n<table><tr>{head}</tr>{body}</table>"


_CSS = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}img{max-width:48%;margin:4px}"
)


def render_html(comparison: dict, images: dict[str, str | None], title: str) -> str:
    """The page: every table, then every image by its file name (relative: the folder can move)."""
    tables = "\n".join(_html_table(*s) for s in sections(comparison))
    imgs = "\n".join(f'<img src="{html.escape(Path(p).name)}" alt="{html.escape(k)}">' for k, p in images.items() if p)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{tables}\n"
        f"<h2>Plots</h2>\n{imgs}\n</body></html>\n"
    )


def write_report(
    comparison: dict, out_dir, *, y=None, p_candidate=None, p_champion=None, title: str = "Candidate vs champion"
) -> dict:
    """Write roc.png, reliability.png, slot_auc.png, fairness.png and report.html into out_dir.

    Returns {"html": path, "roc": path or None, "reliability": path, "slot_auc": path,
    "fairness": path or None} (str paths). ROC needs y and p_candidate (p_champion optional);
    fairness is None when the comparison has no fairness columns.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cand, champ = comparison["candidate"], comparison.get("champion")
    results = {w: r for w, r in zip(_WHO, (cand, champ)) if r is not None}
    scores = {w: p for w, p in zip(_WHO, (p_candidate, p_champion)) if p is not None}
    roc = plot_roc(y, scores, out / "roc.png") if y is not None and "candidate" in scores else None
    rel = plot_reliability({w: r["reliability"] for w, r in results.items()}, out / "reliability.png")
    slots = plot_bars(
        {w: {s: v["auc"] for s, v in r["slots"].items()} for w, r in results.items()},
        "AUC per slot",
        "AUC",
        out / "slot_auc.png",
    )
    gaps = {w: fairness_gaps(r) for w, r in results.items()}
    fair = (
        plot_bars(gaps, "Fairness gaps (lower is fairer)", "max - min over groups", out / "fairness.png")
        if gaps.get("candidate")
        else None
    )
    images = {"roc": roc, "reliability": rel, "slot_auc": slots, "fairness": fair}
    page = out / "report.html"
    page.write_text(render_html(comparison, images, title), encoding="utf-8")
    return {"html": str(page), **images}
