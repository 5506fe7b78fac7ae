"""backtest --choose: the rule (pure), the candidates a config gets, and a short real replay through the CLI."""

import json
import subprocess
import sys

import pytest

from pipelines.bench import backtest_choice as bc
from pipelines.config import load_pipeline_config
from pipelines.errors import ConfigError


def test_the_rule_takes_the_smallest_adapter_within_the_margin_of_the_best():
    rows = {
        "r8": {"auc": 0.670, "adapter_bytes": 15_000},
        "r2": {"auc": 0.6695, "adapter_bytes": 9_000},
        "r16": {"auc": 0.672, "adapter_bytes": 23_000},
        "r4": {"auc": 0.660, "adapter_bytes": 11_000},
    }
    assert bc.choose(rows) == "r2"  # 0.6695 >= 0.672 - 0.003, and the smallest
    assert bc.choose(rows, margin=0.001) == "r16"  # only r16 is near enough to itself
    # equal bytes (the orthogonality lambdas): the default, listed first, unless another wins by the margin
    same = {"lambda_0": {"auc": 0.670, "adapter_bytes": 15_000}, "lambda_1": {"auc": 0.672, "adapter_bytes": 15_000}}
    assert bc.choose(same) == "lambda_0"
    # lambda_10 is best, lambda_1 within the margin of it: the milder option (earlier in the list) is taken
    assert bc.choose({**same, "lambda_10": {"auc": 0.674, "adapter_bytes": 15_000}}) == "lambda_1"
    with pytest.raises(ConfigError, match="no candidate"):
        bc.choose({"r8": {"auc": None, "adapter_bytes": 1}})


def test_a_delta_choice_keeps_the_shipped_recipe_unless_a_variant_beats_it_by_the_margin():
    rows = {
        "shipped": {"auc": 0.7150, "adapter_bytes": 31_000},
        "window_4": {"auc": 0.7143, "adapter_bytes": 27_000},
        "window_14": {"auc": 0.7159, "adapter_bytes": 35_000},
    }
    assert bc.choose(rows) == "window_4"  # by bytes: the shortest window's fewer ids
    assert bc.choose(rows, by_bytes=False) == "shipped"  # by order: within 0.003 of the best
    assert bc.choose({**rows, "l2_3": {"auc": 0.7190, "adapter_bytes": 31_000}}, by_bytes=False) == "l2_3"
    delta = bc.candidates(load_pipeline_config(), "delta")
    assert list(delta)[0] == bc.DEFAULT["delta"] == "shipped" and delta["per_slot"] == {"train_rows": "slot"}
    lora = load_pipeline_config(overrides={"lora": {"kind": "lora", "trainable_tokens": []}})
    with pytest.raises(ConfigError, match="set lora.kind: delta"):
        bc.candidates(lora, "delta")


def test_candidates_follow_the_configs_targets_and_blocks():
    cfg = load_pipeline_config()
    ranks = bc.candidates(cfg, "ranks")
    assert list(ranks)[0] == bc.DEFAULT["ranks"] and {"r2", "r4", "r16"} <= set(ranks)
    assert ranks["r8_upper_blocks_r2"]["rank_pattern"] == {"blocks.1.q_proj": 2, "blocks.1.v_proj": 2}
    one_block = load_pipeline_config(overrides={"model": {"n_blocks": 1}, "lora": {"target_modules": ["v_proj"]}})
    assert set(bc.candidates(one_block, "ranks")) == {"r8", "r2", "r4", "r16"}  # no layer to tell apart
    assert list(bc.candidates(cfg, "orthogonality"))[0] == "lambda_0"
    with pytest.raises(ConfigError, match="unknown choice"):
        bc.candidates(cfg, "dropout")


def test_schedule_candidates_scale_the_configs_lr_and_name_the_top_layer_where_the_model_has_one(text_source):
    cfg = load_pipeline_config(
        overrides={"lora": {"kind": "lora", "trainable_tokens": [], "lr": 0.005, "window_days": 7}}
    )
    sched = bc.candidates(cfg, "schedule")
    assert list(sched)[0] == bc.DEFAULT["schedule"] == "all_layers" and sched["all_layers"] == {}
    assert sched["lr_div5"] == {"lr": 0.001} and sched["lr_div25"] == {"lr": 0.0002}
    assert sched["top_layer_lr_div5_window_x4"] == {"layers": (-1,), "lr": 0.001, "window_days": 28}
    text = load_pipeline_config("configs/movielens_text.yaml", overrides={"model": {"text": {"source": text_source}}})
    assert bc.candidates(text, "schedule")["top_layer"] == {"layers": (-1,)}
    dcn = bc.candidates(load_pipeline_config("configs/movielens_dcn.yaml"), "schedule")
    assert set(dcn) == {"all_layers", "lr_div5", "lr_div25", "keep_base"}  # two layer lists: no top layer
    # a user's family (a dotted path) is asked, not looked up by name: one numbered layer list, a top layer
    users = load_pipeline_config(overrides={"model": {"family": "tests.pipelines.model.test_family:TinyFamily"}})
    assert bc.candidates(users, "schedule")["top_layer"] == {"layers": (-1,)}


@pytest.mark.slow
def test_a_short_choice_through_the_cli_replays_validation_then_test_days(tmp_path):
    config = tmp_path / "fast.yaml"
    config.write_text("base_training: {epochs: 1}\nlora: {epochs: 1}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest",
            "--choose",
            "orthogonality",
            "--only",
            "lambda_10",
            "--days",
            "3",
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
    val, test = r["validation"], r["test"]
    assert (val["from"], val["days"], test["from"], test["days"]) == ("1998-01-20", 3, "1998-03-07", 3)
    assert list(val["candidates"]) == ["static", "lambda_0", "lambda_10"]
    assert r["chosen"] in ("lambda_0", "lambda_10") and set(test["candidates"]) == {"static", "lambda_0", r["chosen"]}
    pen, plain = val["candidates"]["lambda_10"], val["candidates"]["lambda_0"]
    # the first day has no sibling yet; from the second, each adapter is measured against the others
    assert pen["max_abs_cos"]["n"] > 0 and pen["max_abs_cos"]["median"] < plain["max_abs_cos"]["median"]
    assert pen["lora"] == {"orthogonality_lambda": 10.0} and pen["adapter_bytes"] == plain["adapter_bytes"]


@pytest.mark.slow
def test_schedule_through_the_cli_on_fewer_validation_days_with_a_cached_base(tmp_path):
    config = tmp_path / "fast.yaml"
    config.write_text("base_training: {epochs: 1}\nlora: {epochs: 1}\n")
    cache = tmp_path / "bases"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest",
            "--choose",
            "schedule",
            "--only",
            "top_layer_lr_div5",
            "--val-days",
            "1",
            "--days",
            "2",
            "--base-cache",
            str(cache),
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
    assert (r["validation"]["days"], r["test"]["days"]) == (1, 2)  # --val-days limits the validation days only
    assert list(r["validation"]["candidates"]) == ["static", "all_layers", "top_layer_lr_div5"]
    assert r["validation"]["candidates"]["top_layer_lr_div5"]["lora"] == {"layers": [-1], "lr": 0.001}
    # the top layer's adapter is the smaller one: the rule takes it unless it is worse by more than the margin
    top, every = (r["validation"]["candidates"][n] for n in ("top_layer_lr_div5", "all_layers"))
    assert top["adapter_bytes"] < every["adapter_bytes"]
    assert r["chosen"] == ("top_layer_lr_div5" if top["auc"] >= every["auc"] - bc.MARGIN else "all_layers")
    assert len(list(cache.glob("feature_transformer-*.pt"))) == 2  # one base per cutoff: validation and test


@pytest.mark.slow
def test_a_delta_choice_through_the_cli_varies_the_shipped_delta(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest",
            "--choose",
            "delta",
            "--only",
            "per_slot",
            "--days",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    val = r["validation"]["candidates"]
    assert list(val) == ["static", "shipped", "per_slot"] and val["per_slot"]["lora"] == {"train_rows": "slot"}
    assert "earliest candidate" in r["rule"] and r["chosen"] in ("shipped", "per_slot")
    assert all(0.5 < c["auc"] < 0.9 for c in val.values())
