"""model.family: the built-in family, a user's family named by dotted path, and a stored base that names
its family (loaded only when expected: a dotted family is code, never imported on the artifact store's word)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.config import LoraTrainConfig, ModelConfig, load_pipeline_config
from pipelines.data.synthetic import generate_day
from pipelines.errors import ConfigError, RegistryError
from pipelines.model import adapters, family, features, store
from pipelines.model.base import CTRModel, fingerprint
from tests.pipelines.training.helpers import CFG, SPEC

HERE = "tests.pipelines.model.test_family"


class TinyFamily(family.FeatureTransformer):
    """A user's family, as a config names it (`package.module:Factory`): here the built-in network
    with an extra marker, enough to see which one was built."""

    name = f"{HERE}:TinyFamily"

    def build(self, cfg):
        model = super().build(cfg)
        model.built_by = "tiny"
        return model


class NotAFamily:
    name = "half"


def rows():
    return pd.concat(list(generate_day(SPEC, "2024-01-02", 64)), ignore_index=True)


def test_the_default_family_is_the_feature_transformer_and_the_config_lists_every_built_in():
    fam = family.resolve(ModelConfig().family)
    assert isinstance(fam, family.Family) and fam.name == "feature_transformer"
    assert isinstance(fam.build(CFG), CTRModel) and fam.default_targets == ("q_proj", "v_proj")
    frame = rows()
    np.testing.assert_array_equal(fam.encode(frame, CFG), features.encode(frame, CFG))
    assert tuple(family.BUILTIN) == ModelConfig.FAMILIES
    assert load_pipeline_config().model.family == "feature_transformer"


def test_a_dotted_family_is_imported_and_checked():
    cfg = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024, family=f"{HERE}:TinyFamily")
    model = family.build(cfg)
    assert model.built_by == "tiny" and family.of(model).name == cfg.family
    with pytest.raises(ConfigError, match="lacks"):
        family.resolve(f"{HERE}:NotAFamily")
    with pytest.raises(ConfigError, match="cannot import"):
        family.resolve("no_such_package.module:Factory")
    for bad in ("deepfm", "a b:c", "module_only", 3):
        with pytest.raises(ConfigError, match="model.family"):
            ModelConfig(family=bad)


def test_a_stored_base_loads_its_family_only_when_expected(tmp_path):
    torch.manual_seed(0)
    tiny_cfg = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024, family=f"{HERE}:TinyFamily")
    model = family.build(tiny_cfg)
    meta = store.save_base(model, tmp_path / "tiny")
    assert meta["model"]["family"] == tiny_cfg.family
    with pytest.raises(RegistryError, match="refusing to load"):
        store.load_base(tmp_path / "tiny")  # not built in, not expected
    loaded = store.load_base(tmp_path / "tiny", family=tiny_cfg.family)
    assert loaded.built_by == "tiny" and fingerprint(loaded) == fingerprint(model)

    # a config edited in the artifact store to name another module: refused before anything is imported
    path = tmp_path / "tiny" / store.CONFIG
    edited = json.loads(path.read_text())
    edited["model"]["family"] = "no_such_package.evil:Factory"
    path.write_text(json.dumps(edited))
    with pytest.raises(RegistryError, match="no_such_package.evil:Factory"):
        store.load_base(tmp_path / "tiny", family=tiny_cfg.family)


def test_a_base_stored_before_families_existed_loads_as_the_default(tmp_path):
    torch.manual_seed(0)
    model = CTRModel(CFG)
    store.save_base(model, tmp_path)
    path = tmp_path / store.CONFIG
    legacy = json.loads(path.read_text())
    del legacy["model"]["family"]
    path.write_text(json.dumps(legacy))
    assert fingerprint(store.load_base(tmp_path)) == fingerprint(model)
    assert fingerprint(store.load_base(tmp_path, family="feature_transformer")) == fingerprint(model)


@pytest.mark.parametrize("name", list(family.BUILTIN))
def test_each_built_in_familys_default_targets_are_allowed_and_wrap_its_modules(name):
    fam = family.resolve(name)
    assert set(fam.default_targets) <= ModelConfig.FAMILY_TARGETS[name]
    model = adapters.attach(
        fam.build(ModelConfig(embed_dim=16, n_heads=2, id_buckets=1024, family=name)),
        LoraTrainConfig(target_modules=fam.default_targets),
    )
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert wrapped == set(fam.default_targets)
    out = model(torch.from_numpy(features.encode(rows(), model.get_base_model().cfg)))
    assert out.shape == (64,) and torch.isfinite(out).all()


def test_the_config_refuses_targets_and_a_cold_start_init_the_family_lacks():
    with pytest.raises(
        ConfigError, match=r"lora.target_modules \['q_proj', 'v_proj'\] are not modules of model.family"
    ):
        load_pipeline_config(overrides={"model": {"family": "dcn"}})
    dcn_targets = {"target_modules": ["cross_proj", "deep_proj"]}
    with pytest.raises(ConfigError, match="cold_start.init: covariance needs the feature_transformer family"):
        load_pipeline_config(overrides={"model": {"family": "dcn"}, "lora": dcn_targets, "cold_start": dcn_targets})
    with pytest.raises(ConfigError, match="not modules of model.family 'feature_transformer'"):
        load_pipeline_config(overrides={"lora": dcn_targets})


@pytest.mark.parametrize(
    "name,path", [("dcn", "configs/movielens_dcn.yaml"), ("minilm_text", "configs/movielens_text.yaml")]
)
def test_each_shipped_family_config_is_the_default_one_on_that_family(name, path):
    """configs/movielens_<family>.yaml: the family's default targets, the default cold-start init, and
    otherwise pipeline.yaml's data and validation (the same demo on another network)."""
    shipped, default = load_pipeline_config(path), load_pipeline_config()
    assert (shipped.model.family, shipped.cold_start.init) == (name, "default")
    assert tuple(shipped.lora.target_modules) == family.resolve(name).default_targets
    assert tuple(shipped.cold_start.target_modules) == family.resolve(name).default_targets
    assert (shipped.data, shipped.validation, shipped.registry) == (default.data, default.validation, default.registry)
