"""The report: real PNG files, an HTML page that embeds them with the numbers, and the log table."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from pipelines.evaluation.report import format_table, fmt, write_report
from pipelines.evaluation.slices import compare_predictions
from tests.pipelines.evaluation.test_slices import click_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ODD_SLOT = "a<b&c"  # must come out escaped in the page


@pytest.fixture(scope="module")
def comparison():
    frame, y, good, weak = click_rows(1500, seed=3)
    frame.loc[frame["slot"] == "night", "slot"] = ODD_SLOT
    cold = (frame["user_id"].str.len() == 2).to_numpy()
    return compare_predictions(frame, y, good, weak, cold_mask=cold, slice_min_rows=50), y, good, weak


def assert_png(path: str) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, path


def test_write_report_files_and_html(comparison, tmp_path):
    c, y, good, weak = comparison
    paths = write_report(c, tmp_path / "out", y=y, p_candidate=good, p_champion=weak, title="ctr_lora_feed v3 <test>")
    assert set(paths) == {"html", "roc", "reliability", "slot_auc", "fairness"}
    for k in ("roc", "reliability", "slot_auc", "fairness"):
        assert Path(paths[k]).parent == tmp_path / "out"
        assert_png(paths[k])
    page = Path(paths["html"]).read_text(encoding="utf-8")
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(srcs) == ["fairness.png", "reliability.png", "roc.png", "slot_auc.png"]  # relative paths
    for number in (
        c["candidate"]["overall"]["auc"],
        c["champion"]["overall"]["auc"],
        c["delong"]["p_value"],
        c["delong"]["diff"],
        c["candidate"]["gauc"]["gauc"],
        c["candidate"]["slots"]["morning"]["auc"],
        c["champion"]["cold_warm"]["cold"]["auc"],
        c["candidate"]["fairness"]["gender"]["equalized_odds"]["equalized_odds_difference"],
    ):
        assert f"<td>{fmt(number)}</td>" in page, number
    assert html.escape(ODD_SLOT) in page and ODD_SLOT not in page
    assert "ctr_lora_feed v3 &lt;test&gt;" in page


def test_write_report_without_raw_scores_or_champion(comparison, tmp_path):
    c, *_ = comparison
    paths = write_report(c, tmp_path)
    assert paths["roc"] is None and not (tmp_path / "roc.png").exists()
    assert_png(paths["slot_auc"])
    assert "roc.png" not in Path(paths["html"]).read_text(encoding="utf-8")

    frame, y, good, _ = click_rows(400, seed=4)
    alone = compare_predictions(frame, y, good, None, fairness_columns=())
    paths = write_report(alone, tmp_path / "alone", y=y, p_candidate=good)
    assert paths["fairness"] is None
    assert_png(paths["roc"])
    assert "no champion" in Path(paths["html"]).read_text(encoding="utf-8")


def test_fmt():
    values = [None, float("nan"), 3, True, 0.5, 0.0, 1.5e-5, -0.01234, "x"]
    assert [fmt(v) for v in values] == ["-", "-", "3", "True", "0.5000", "0.0000", "1.50e-05", "-0.0123", "x"]


def test_format_table(comparison):
    c, *_ = comparison
    text = format_table(c)
    titles = [line for line in text.splitlines() if line.startswith("== ")]
    assert [t.split(" (")[0] for t in titles] == [
        "== Overall",
        "== DeLong test",
        "== Per slot",
        "== Cold / warm",
        "== Fairness gaps",
    ]
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line and not line.startswith("==")}
    cand, champ = c["candidate"]["overall"], c["champion"]["overall"]
    assert lines["auc"] == ["auc", fmt(cand["auc"]), fmt(champ["auc"]), fmt(cand["auc"] - champ["auc"])]
    assert lines["rows"] == ["rows", "1500", "1500", "0"]
    assert lines["morning"][:4] == [
        "morning",
        str(c["candidate"]["slots"]["morning"]["rows"]),
        fmt(c["candidate"]["slots"]["morning"]["ctr"]),
        fmt(c["candidate"]["slots"]["morning"]["auc"]),
    ]
    d = c["delong"]
    delong_row = text.splitlines()[text.splitlines().index(titles[1]) + 2].split()
    assert delong_row == [
        fmt(v)
        for v in (d["auc_a"], d["auc_b"], d["diff"], d["se"], *d["ci95"], d["z"], d["p_value"], d["n_pos"], d["n_neg"])
    ]
    # fixed width: numbers are right-aligned, so every cell of a column ends where its header ends
    block = text.split("== ")[1].splitlines()[1:]
    for col in ("candidate", "champion"):
        end = block[0].index(col) + len(col)
        assert all(line[end - 1] != " " and line[end : end + 1] in (" ", "") for line in block), col
