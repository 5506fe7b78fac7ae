"""Typed config: YAML defaults, unknown keys, types, Literal choices, range checks, overrides, hashing."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from pipelines import config as C
from pipelines.config import (
    GatePolicy,
    LoraTrainConfig,
    ModelConfig,
    PipelineConfig,
    ValidationConfig,
    config_hash,
    load_gate_policy,
    load_pipeline_config,
    to_dict,
)
from pipelines.errors import ConfigError
from pipelines.training import distill


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    """The loaders read $CTR_PIPELINE_CONFIG / $CTR_GATE_POLICY: make sure the repo files are used."""
    monkeypatch.delenv("CTR_PIPELINE_CONFIG", raising=False)
    monkeypatch.delenv("CTR_GATE_POLICY", raising=False)


def write_yaml(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ----------------------------------------------------------------------------- defaults
def test_pipeline_defaults_load_from_the_repo_yaml():
    cfg = load_pipeline_config()
    assert isinstance(cfg, PipelineConfig)
    raw = yaml.safe_load(C.DEFAULT_PIPELINE_YAML.read_text())
    # Every value in the YAML file made it into the config, with YAML lists as tuples.
    assert to_dict(cfg) == raw
    assert cfg.lora.target_modules == ("q_proj", "v_proj")
    assert cfg.data.slots == ("morning", "afternoon", "night")
    assert isinstance(cfg.model.embed_dim, int) and isinstance(cfg.base_training.lr, float)
    assert cfg.adapter_model_name("night") == "ctr_lora_night"


def test_repo_yaml_agrees_with_dataclass_defaults():
    """The shipped YAML restates the code defaults, except the validation bands that MovieLens needs
    wider and the recipe chosen on the backtest's validation days (a wide LR base, a delta adapter), both
    documented in the YAML; a silent drift between them would be confusing."""
    cfg = load_pipeline_config()
    recipe = {
        "model": {"wide": True, "wide_id_buckets": 1048576, "small_buckets": 1024},
        "base_training": {
            "wide_l2": 3.33,
            "wide_l2_grid": (33.3, 10.0, 3.33, 1.0, 0.333),
            "wide_fields": ("user_id", "item_id", "gender", "age_bucket", "occupation", "category", "slot"),
            "refit_all_rows": True,
        },
        "lora": {
            "kind": "delta",
            "train_rows": "all",
            "lr": 0.3,
            "window_days": 7,
            "val_fraction": 0.0,
            "trainable_tokens": ("user_id", "item_id"),
            "judged_on": "next_day",
        },
    }
    defaults = PipelineConfig()
    assert {s: {k: getattr(getattr(cfg, s), k) for k in keys} for s, keys in recipe.items()} == recipe
    assert {s: {k: getattr(getattr(defaults, s), k) for k in keys} for s, keys in recipe.items()} != recipe
    restated = dataclasses.replace(
        cfg,
        validation=ValidationConfig(),
        **{
            s: dataclasses.replace(getattr(cfg, s), **{k: getattr(getattr(defaults, s), k) for k in keys})
            for s, keys in recipe.items()
        },
    )
    assert restated == defaults
    assert cfg.validation.drift_action == "warn" and ValidationConfig().drift_action == "fail"
    # the prequential gate's release (chosen on the validation days, docs/benchmarks.md)
    assert load_gate_policy() == GatePolicy(
        optional_checks=("fairness_dp", "fairness_eo"), promotion="direct", judge_margin=0.01, judge_release="successor"
    )


def test_gate_policy_defaults_load_from_the_repo_yaml():
    pol = load_gate_policy()
    raw = yaml.safe_load(C.DEFAULT_GATE_YAML.read_text())
    assert to_dict(pol) == raw
    assert pol.promotion == "direct" and pol.auc_tolerance == pytest.approx(0.0015) and pol.approval is False


def test_env_var_selects_the_pipeline_file(tmp_path, monkeypatch):
    p = write_yaml(tmp_path / "p.yaml", {"model": {"embed_dim": 16, "n_heads": 2}})
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", p)
    cfg = load_pipeline_config()
    assert cfg.model.embed_dim == 16 and cfg.model.n_heads == 2
    assert cfg.lora == LoraTrainConfig()  # sections absent from the file keep their defaults


# ----------------------------------------------------------------------------- unknown keys
def test_unknown_top_level_key_is_rejected_by_name(tmp_path):
    p = write_yaml(tmp_path / "p.yaml", {"modle": {"embed_dim": 16}})
    with pytest.raises(ConfigError, match="modle"):
        load_pipeline_config(p)


def test_unknown_nested_key_is_rejected_by_name(tmp_path):
    p = write_yaml(tmp_path / "p.yaml", {"lora": {"rank": 4}})
    with pytest.raises(ConfigError, match=r"lora.*rank"):
        load_pipeline_config(p)


def test_unknown_key_in_gate_policy_is_rejected(tmp_path):
    p = write_yaml(tmp_path / "g.yaml", {"auc_tolerence": 0.01})
    with pytest.raises(ConfigError, match="auc_tolerence"):
        load_gate_policy(p)


def test_unknown_key_in_overrides_is_rejected():
    with pytest.raises(ConfigError, match="embedding_dim"):
        load_pipeline_config(overrides={"model": {"embedding_dim": 8}})


# ----------------------------------------------------------------------------- types
@pytest.mark.parametrize(
    "section,key,value",
    [
        ("model", "embed_dim", "32"),  # string for int
        ("model", "n_blocks", True),  # bool for int
        ("lora", "r", 8.0),  # float for int
        ("lora", "lr", "0.01"),  # string for float
        ("base_training", "lr", False),  # bool for float
        ("data", "slots", "morning"),  # string for a list
        ("lora", "target_modules", ["q_proj", 3]),  # wrong element type
        ("registry", "experiment", 5),  # int for str
    ],
)
def test_wrong_type_is_rejected_naming_the_key(section, key, value):
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        load_pipeline_config(overrides={section: {key: value}})


def test_section_that_is_not_a_mapping_is_rejected():
    with pytest.raises(ConfigError, match="model must be a mapping"):
        load_pipeline_config(overrides={"model": [1, 2]})


def test_int_is_accepted_for_float_and_coerced():
    cfg = load_pipeline_config(overrides={"lora": {"lr": 1}})
    assert cfg.lora.lr == 1.0 and isinstance(cfg.lora.lr, float)


def test_literal_choice_is_rejected(tmp_path):
    p = write_yaml(tmp_path / "g.yaml", {"promotion": "staged"})
    with pytest.raises(ConfigError, match=r"promotion must be one of \['canary', 'direct'\].*staged"):
        load_gate_policy(p)


# ----------------------------------------------------------------------------- ranges
@pytest.mark.parametrize(
    "cls,kwargs,fragment",
    [
        (LoraTrainConfig, {"r": 0}, "lora.r"),
        (LoraTrainConfig, {"alpha": 0}, "lora.r and lora.alpha"),
        (LoraTrainConfig, {"target_modules": ("q_proj", "")}, "target_modules"),
        (LoraTrainConfig, {"target_modules": ()}, "target_modules"),
        (LoraTrainConfig, {"dropout": 1.0}, "lora.dropout"),
        (LoraTrainConfig, {"holdout_fraction": 0.5}, "holdout_fraction"),
        (ModelConfig, {"embed_dim": 30, "n_heads": 4}, "multiple of model.n_heads"),
        (ModelConfig, {"embed_dim": 0}, "embed_dim"),
        (ModelConfig, {"n_heads": 0}, "n_heads"),
        (ModelConfig, {"n_heads": -4}, "n_heads"),
        (ModelConfig, {"n_blocks": 0}, "n_blocks"),
        (ModelConfig, {"id_buckets": 1}, "buckets"),
        (C.ValidationConfig, {"label_rate_min": 0.5, "label_rate_max": 0.4}, "label_rate_min"),
        (C.BaseTrainConfig, {"lr": 0.0}, "base_training.lr"),
        (C.DataConfig, {"slots": ("a", "a")}, "distinct"),
        (C.DataConfig, {"lake_uri": "gs://bucket/x"}, "lake_uri"),
        (GatePolicy, {"auc_tolerance": 0.5}, "auc_tolerance"),
        (GatePolicy, {"min_auc_first_run": 1.5}, "min_auc_first_run"),
    ],
)
def test_post_init_range_checks(cls, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        cls(**kwargs)


def test_range_checks_also_apply_when_loading(tmp_path):
    p = write_yaml(tmp_path / "p.yaml", {"lora": {"target_modules": ["q_proj", "out_proj"]}})
    with pytest.raises(ConfigError, match=r"lora.target_modules \['out_proj'\] are not modules of model.family"):
        load_pipeline_config(p)
    with pytest.raises(ConfigError, match=r"lora.target_modules \['embedding'\] are not modules"):  # a typo
        load_pipeline_config(overrides={"lora": {"target_modules": ["embedding"]}})
    p = write_yaml(tmp_path / "c.yaml", {"cold_start": {"target_modules": ["q_proj", "embeddings"]}})
    with pytest.raises(ConfigError, match="cold_start.target_modules cannot name embeddings"):
        load_pipeline_config(p)
    # a user's family names its own modules: PEFT, not the config, finds out whether they exist
    own = {
        "model": {"family": "tests.pipelines.model.test_family:TinyFamily"},
        "lora": {"target_modules": ["query", "value"]},
    }
    assert load_pipeline_config(overrides=own).lora.target_modules == ("query", "value")


def test_valid_edge_values_are_accepted():
    assert LoraTrainConfig(r=1, alpha=1, target_modules=("o_proj",)).r == 1
    assert ModelConfig(embed_dim=16, n_heads=16, n_blocks=1).embed_dim == 16
    assert GatePolicy(auc_tolerance=0.0, min_auc_first_run=0.5).auc_tolerance == 0.0


# ----------------------------------------------------------------------------- overrides
def test_overrides_deep_merge_into_the_file(tmp_path):
    p = write_yaml(tmp_path / "p.yaml", {"model": {"embed_dim": 16, "n_heads": 2}, "lora": {"r": 4, "alpha": 8}})
    cfg = load_pipeline_config(p, overrides={"model": {"n_blocks": 1}, "lora": {"r": 2}})
    assert (cfg.model.embed_dim, cfg.model.n_heads, cfg.model.n_blocks) == (16, 2, 1)  # file + override
    assert (cfg.lora.r, cfg.lora.alpha) == (2, 8)  # override wins, sibling key from file kept
    assert cfg.model.ffn_mult == ModelConfig().ffn_mult  # neither: dataclass default


def test_gate_policy_overrides():
    pol = load_gate_policy(overrides={"auc_tolerance": 0.01})
    assert pol.auc_tolerance == 0.01 and pol.min_auc_first_run == GatePolicy().min_auc_first_run


def test_config_is_frozen():
    cfg = load_pipeline_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.embed_dim = 8  # type: ignore[misc]


# ----------------------------------------------------------------------------- hash
def test_config_hash_is_stable_and_sensitive():
    a, b = load_pipeline_config(), load_pipeline_config()
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 64 and int(config_hash(a), 16) >= 0
    changed = load_pipeline_config(overrides={"lora": {"r": 4}})
    assert config_hash(changed) != config_hash(a)
    assert config_hash(a.lora) != config_hash(changed.lora)
    assert config_hash(a.model) == config_hash(changed.model)  # the untouched section keeps its hash
    # a tiny float change is visible too
    assert config_hash(GatePolicy(auc_tolerance=0.0015)) != config_hash(GatePolicy(auc_tolerance=0.0016))


def test_to_dict_round_trips_through_from_dict():
    cfg = load_pipeline_config(overrides={"model": {"embed_dim": 16, "n_heads": 2}})
    assert C.from_dict(PipelineConfig, to_dict(cfg)) == cfg


# ----------------------------------------------------------------------------- files
def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_gate_policy(tmp_path / "nope.yaml")


def test_invalid_yaml_is_a_config_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {embed_dim: 16\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipeline_config(p)


def test_empty_file_gives_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load_pipeline_config(p) == PipelineConfig()


# ----------------------------------------------------------------------------- shared adapter shape, loss weights
def test_both_adapter_configs_share_one_lora_shape_with_flat_yaml_keys():
    cfg = load_pipeline_config(overrides={"lora": {"r": 4}, "cold_start": {"r": 2, "alpha": 4}})
    assert isinstance(cfg.lora, C.LoraShape) and isinstance(cfg.cold_start, C.LoraShape)
    assert (cfg.lora.r, cfg.cold_start.r, cfg.cold_start.alpha) == (4, 2, 4)
    assert {"r", "alpha", "target_modules"} <= set(to_dict(cfg.cold_start)) and "shape" not in to_dict(cfg.lora)
    # the same checks, named after the section; only the slot adapters may wrap the embedding tables
    with pytest.raises(ConfigError, match=r"cold_start\.r and cold_start\.alpha"):
        C.ColdStartConfig(alpha=0)
    with pytest.raises(ConfigError, match=r"cold_start\.target_modules"):
        C.ColdStartConfig(target_modules=("q_proj", "embeddings"))
    assert LoraTrainConfig(target_modules=("q_proj", "embeddings")).target_modules == ("q_proj", "embeddings")


def test_cold_start_loss_weights_come_from_its_flat_keys():
    cs = load_pipeline_config(overrides={"cold_start": {"w_kd": 2.0, "align": "cosine"}}).cold_start
    assert cs.loss_weights == C.LossWeights(
        bce=cs.w_bce, kd=2.0, align=cs.w_align, temperature=cs.temperature, align_kind="cosine"
    )
    assert distill.LossWeights is C.LossWeights  # one definition, used by the distillation loop


def test_the_text_familys_gate_policy_is_the_default_with_a_transformers_latency_budget():
    text = load_gate_policy("configs/gate_policy_text.yaml")
    assert text.latency_budget_ms == 2000.0
    assert dataclasses.replace(text, latency_budget_ms=load_gate_policy().latency_budget_ms) == load_gate_policy()
