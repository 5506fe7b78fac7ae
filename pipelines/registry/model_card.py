"""A model card (markdown) per registered version: what it was trained on, how it scored overall, per
slice and on fairness, and what the gate decided.

It is the version's *description* in the MLflow registry (so the UI shows it on the version's page)
and an artifact of its training run (`model_card/v<version>.md`). It is rendered from the version's
tags and the evaluation dict, and published again after the gate so the decision is on it.
"""

from __future__ import annotations

import json

from pipelines.metrics import check_result
from pipelines.registry import mlflow_io

# MLflow keeps a version description in one database column; a card is a summary, so cap it.
MAX_DESCRIPTION = 5000


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out


def _metrics_rows(
    cand: dict, champ: dict | None, keys=("auc", "logloss", "ne", "calibration_ratio", "ece", "gauc", "rows")
) -> list[list]:
    return [[k, cand.get(k), (champ or {}).get(k)] for k in keys if k in cand]


def render(name: str, version: str, tags: dict, evaluation: dict | None = None, decision: dict | None = None) -> str:
    t = tags
    lines = [f"# {name} v{version}", ""]
    lines += ["## Trained on", ""]
    lines += _table(
        ["what", "value"],
        [
            ["slot", t.get("slot")],
            ["data window", f"{t.get('data.first')} .. {t.get('data.last')} ({t.get('data.partitions')} partitions)"],
            ["data sha256", (t.get("data.sha256") or "")[:16]],
            [
                "base model",
                f"{t.get('base.name')} v{t.get('base.version')} (fingerprint {(t.get('base.fingerprint') or '')[:12]})",
            ],
            ["config hash", (t.get("config.hash") or "")[:16]],
            ["code version", t.get("code.version")],
            ["training run", t.get("training.run_id")],
        ],
    )
    if evaluation:
        cand, champ = evaluation.get("candidate") or {}, evaluation.get("champion")
        vs = f"champion v{evaluation.get('champion_version')}" if champ else "champion (none yet)"
        where = (
            f"{evaluation['judged_day']}, a day after its window (judged there beside the champion)"
            if evaluation.get("judged_day")
            else "the holdout"
        )
        lines += ["", f"## Metrics on {where}", "", f"{evaluation.get('holdout_rows', cand.get('rows'))} rows."]
        if evaluation.get("sequential"):
            q = evaluation["sequential"]
            # no champion to pair with: there are no paired rows, not "None" of them
            paired = f"{q['n']} paired rows" if q.get("n") is not None else "no paired rows (no champion)"
            lines += [
                "",
                f"Sequential test over {q.get('days')} judged day(s), {paired}: {q.get('verdict')} "
                f"({q.get('reason')}).",
            ]
        lines += [""] + _table(["metric", "this version", vs], _metrics_rows(cand, champ))
        if evaluation.get("delong"):
            d = evaluation["delong"]
            lines += [
                "",
                f"DeLong (this − champion): ΔAUC {_fmt(d.get('diff'))}, 95% CI "
                f"[{_fmt((d.get('ci95') or [None, None])[0])}, {_fmt((d.get('ci95') or [None, None])[1])}], "
                f"p = {_fmt(d.get('p_value'))}",
            ]
        for title, key in (("Per slot", "slots"), ("Cold-start vs warm users", "cold_warm")):
            part = (evaluation.get("report") or {}).get(key) or {}
            if part:
                lines += ["", f"## {title}", ""]
                lines += _table(
                    ["slice", "AUC", "logloss", "rows"],
                    [[s, m.get("auc"), m.get("logloss"), m.get("rows")] for s, m in part.items()],
                )
        fair = (evaluation.get("report") or {}).get("fairness") or {}
        if fair:
            lines += ["", "## Fairness", ""]
            lines += _table(
                ["attribute", "demographic parity diff", "equalized odds diff"],
                [
                    [a, f.get("demographic_parity_difference"), f.get("equalized_odds_difference")]
                    for a, f in fair.items()
                ],
            )
    lines += ["", "## Gate", ""]
    if decision:
        verdict = "passed" if decision.get("passed") else "rejected"
        lines += [
            f"**{verdict}**"
            + (" (first run: absolute thresholds only)" if decision.get("first_run") else "")
            + (
                f"; override by {decision['override']['actor']}: {decision['override']['reason']}"
                if decision.get("override")
                else ""
            ),
            "",
        ]
        lines += _table(
            ["check", "value", "threshold", "result", "reason"],
            [[c["name"], c["value"], c["threshold"], check_result(c), c["reason"]] for c in decision.get("checks", [])],
        )
    else:
        lines += ["pending (not gated yet)"]
    return "\n".join(lines) + "\n"


def publish(name: str, version: str, evaluation: dict | None = None, decision: dict | None = None) -> str:
    """Render the card from the version's current tags and store it (description + run artifact)."""
    c = mlflow_io.client()
    mv = c.get_model_version(name, str(version))
    if evaluation is None and mv.tags.get("eval.candidate"):
        evaluation = {
            "candidate": json.loads(mv.tags["eval.candidate"]),
            "champion": json.loads(mv.tags.get("eval.champion") or "null"),
            "champion_version": mv.tags.get("eval.champion_version") or None,
        }
    card = render(name, str(version), dict(mv.tags), evaluation, decision)
    description = (
        card
        if len(card) <= MAX_DESCRIPTION
        else card[: MAX_DESCRIPTION - 40] + "\n\n(truncated: see the run artifact)\n"
    )
    c.update_model_version(name, str(version), description=description)
    if mv.run_id:
        c.log_text(mv.run_id, card, f"model_card/v{version}.md")
    return card
