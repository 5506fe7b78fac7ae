"""backtest --choose base: the rule (pure), the candidates as configs, and a short real choice through the CLI."""

import json
import subprocess
import sys

import pytest

from pipelines.bench import backtest_base_choice as bbc
from pipelines.config import load_pipeline_config
from pipelines.errors import ConfigError


def test_the_rule_keeps_the_earliest_candidate_within_the_margin_of_the_best_mean():
    assert bbc.choose({"shipped": 0.7030, "fixed_l2": 0.7055}) == "shipped"  # inside the margin
    assert bbc.choose({"shipped": 0.7030, "fixed_l2": 0.7070}) == "fixed_l2"  # beyond it
    assert bbc.choose({"shipped": None, "a": 0.70, "b": 0.701}) == "a"  # unscored: skipped
    with pytest.raises(ConfigError, match="no candidate"):
        bbc.choose({"shipped": None})


def test_each_candidate_undoes_one_shipped_setting_and_the_last_is_the_recipe_it_replaced():
    cfg = load_pipeline_config()
    assert bbc.variant(cfg, bbc.BASE_VARIANTS["shipped"]) == cfg
    fixed = bbc.variant(cfg, bbc.BASE_VARIANTS["fixed_l2"])
    assert fixed.base_training.wide_l2_grid == () and fixed.base_training.wide_l2 == cfg.base_training.wide_l2
    assert bbc.variant(cfg, bbc.BASE_VARIANTS["wide_ids_2e14"]).model.wide_id_buckets == 0
    before = bbc.variant(cfg, bbc.BASE_VARIANTS["before"])
    assert (before.model.small_buckets, before.model.wide_id_buckets, before.base_training.wide_fields) == (64, 0, ())
    with pytest.raises(ConfigError, match="model and base_training only"):
        bbc.variant(cfg, {"lora": {"r": 2}})


@pytest.mark.slow
def test_a_short_base_choice_through_the_cli_scores_every_cut_then_the_test_days(tmp_path):
    config = tmp_path / "fast.yaml"
    config.write_text("base_training: {epochs: 1}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest",
            "--choose",
            "base",
            "--only",
            "fixed_l2",
            "--days",
            "2",
            "--config",
            str(config),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    per_cut = r["validation"]["per_cut"]
    assert list(per_cut) == ["shipped", "fixed_l2", "lr_static"]
    assert [c["from"] for c in per_cut["shipped"]] == [first for first, _ in bbc.CUTS]
    assert all(0.5 < c["auc"] < 0.9 for rows in per_cut.values() for c in rows)
    assert r["validation"]["mean_auc"]["fixed_l2"] == round(sum(c["auc"] for c in per_cut["fixed_l2"]) / 3, 4)
    assert r["chosen"] == bbc.choose({n: r["validation"]["mean_auc"][n] for n in ("shipped", "fixed_l2")})
    assert r["test"]["from"] == "1998-03-07" and {"shipped", "lr_static", r["chosen"]} == set(r["test"]["candidates"])
    refused = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest", "--choose", "base", "--val-days", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "--val-days" in refused.stderr
