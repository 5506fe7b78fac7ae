"""One typed config dataclass per stage, validated in __post_init__, loaded from YAML.

Unknown keys are rejected (a typo in a YAML file must not silently fall back to a default): the
loader is pipelines.config_loader.
`configs/pipeline.yaml` holds the sections below; `configs/gate_policy.yaml` holds GatePolicy
(pipelines.config_gate, imported from here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from pipelines.config_gate import DEFAULT_GATE_YAML, GatePolicy, load_gate_policy  # noqa: F401 (the one import point)
from pipelines.config_loader import check as _check, deep_merge, from_dict, read_yaml
from pipelines.config_model import TEXT_FIELDS, ModelConfig, TextConfig  # noqa: F401 (the one import point)
from pipelines.config_adapter import LoraShape, LoraTrainConfig  # noqa: F401 (the one import point)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PIPELINE_YAML = REPO_ROOT / "configs" / "pipeline.yaml"


@dataclass(frozen=True)
class DataConfig:
    lake_uri: str = "s3://ctr-lake/clicks"
    slots: tuple[str, ...] = ("morning", "afternoon", "night")
    # The lakes a DAG run may be pointed at instead of lake_uri (its form field, the lake of its
    # triggering event); any other is refused: a form field must not make a worker read any bucket or
    # path. Empty: lake_uri only.
    allowed_lakes: tuple[str, ...] = ()

    def __post_init__(self):
        for lake in (self.lake_uri, *self.allowed_lakes):
            _check(
                isinstance(lake, str) and (lake.startswith(("s3://", "/", "./", "file://")) or "://" not in lake),
                f"data.lake_uri and data.allowed_lakes must be s3:// URIs or local paths, got {lake!r}",
            )
        _check(
            len(self.slots) > 0 and len(set(self.slots)) == len(self.slots),
            f"data.slots must be a non-empty list of distinct names, got {list(self.slots)}",
        )

    def lakes(self) -> tuple[str, ...]:
        """Every lake a run may read: lake_uri, then allowed_lakes."""
        return tuple(dict.fromkeys((self.lake_uri, *self.allowed_lakes)))

    def checked_lake(self, lake: str | None) -> str:
        """`lake` when it is one of `lakes()` (a trailing / aside), lake_uri for None; else ConfigError."""
        found = [k for k in self.lakes() if not lake or str(lake).rstrip("/") == k.rstrip("/")]
        _check(
            bool(found),
            f"lake {lake!r} is not allowed: a run may read data.lake_uri ({self.lake_uri}) or a "
            f"lake listed in data.allowed_lakes ({list(self.allowed_lakes)}) of the pipeline config",
        )
        return found[0]


@dataclass(frozen=True)
class ValidationConfig:
    # absolute checks (every partition)
    label_rate_min: float = 0.01
    label_rate_max: float = 0.9
    label_rate_min_rows: int = 50
    min_rows: int = 1
    max_null_fraction_side: float = 0.05
    max_id_length: int = 64
    max_duplicate_fraction: float = 0.01
    unexpected_columns: Literal["fail", "warn"] = "fail"
    # checks relative to the reference window: the trailing validated partitions
    reference_partitions: int = 7
    volume_ratio_min: float = 0.5
    volume_ratio_max: float = 2.0
    label_rate_rel_tolerance: float = 0.5
    label_rate_z: float = 3.0
    drift_psi_max: float = 0.2
    drift_numeric_psi_max: float = 0.2
    drift_min_rows: int = 500
    drift_action: Literal["fail", "warn"] = "fail"
    # the partition's meaning (validation.consistency): faults that pass the schema and event-time checks
    max_item_category_mismatch: float = 0.05  # rows whose item has another category than in the reference
    max_replayed_fraction: float = 0.01  # rows repeating a reference impression at the same time of day
    stuck_column_p: float = 1e-4  # below: one value all day / a slot missing is a fault
    max_single_column_auc: float = 0.95  # one column's click rate separating the labels: a leak
    label_leak_min_rows: int = 50  # smaller partitions: the leak check does not run

    def __post_init__(self):
        _check(
            0.0 <= self.label_rate_min < self.label_rate_max <= 1.0,
            f"validation.label_rate_min/max must satisfy 0 <= min < max <= 1, got "
            f"{self.label_rate_min}/{self.label_rate_max}",
        )
        _check(self.min_rows >= 1, f"validation.min_rows must be >= 1, got {self.min_rows}")
        _check(self.label_rate_min_rows >= 0, "validation.label_rate_min_rows must be >= 0")
        _check(0.0 <= self.max_null_fraction_side <= 1.0, "validation.max_null_fraction_side must be in [0, 1]")
        _check(self.max_id_length >= 1, "validation.max_id_length must be >= 1")
        _check(0.0 <= self.max_duplicate_fraction < 1.0, "validation.max_duplicate_fraction must be in [0, 1)")
        _check(self.reference_partitions >= 1, "validation.reference_partitions must be >= 1")
        _check(
            0.0 <= self.volume_ratio_min <= 1.0 <= self.volume_ratio_max,
            f"validation.volume_ratio_min/max must satisfy 0 <= min <= 1 <= max, got "
            f"{self.volume_ratio_min}/{self.volume_ratio_max}",
        )
        _check(0.0 < self.label_rate_rel_tolerance, "validation.label_rate_rel_tolerance must be > 0")
        _check(self.label_rate_z >= 0.0, "validation.label_rate_z must be >= 0")
        _check(self.drift_psi_max > 0 and self.drift_numeric_psi_max > 0, "validation.drift_*_max must be > 0")
        _check(self.drift_min_rows >= 0, "validation.drift_min_rows must be >= 0")
        _check(
            0.0 <= self.max_item_category_mismatch <= 1.0 and 0.0 <= self.max_replayed_fraction <= 1.0,
            "validation.max_item_category_mismatch and max_replayed_fraction must be in [0, 1]",
        )
        _check(0.0 <= self.stuck_column_p < 1.0, "validation.stuck_column_p must be in [0, 1)")
        _check(0.5 < self.max_single_column_auc <= 1.0, "validation.max_single_column_auc must be in (0.5, 1]")
        _check(self.label_leak_min_rows >= 1, "validation.label_leak_min_rows must be >= 1")


@dataclass(frozen=True)
class BaseTrainConfig:
    train_start: str = "1997-09-01"
    epochs: int = 4
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 20
    holdout_fraction: float = 0.1
    seed: int = 7
    # > 0: the wide term (model.wide) is first fitted alone as a one-hot logistic regression with this L2
    # (1 / C of sklearn's LogisticRegression), then frozen while the rest trains `epochs` (training.wide).
    wide_l2: float = 0.0
    wide_fields: tuple[str, ...] = ()  # the fields that LR reads; () = every field
    # Non-empty (with wide_l2 > 0): the LR's L2 is chosen from these at every fit, by AUC on the newest
    # holdout_fraction of the rows it is given, then refitted on all of them (training.wide.choose_l2).
    wide_l2_grid: tuple[float, ...] = ()
    # True: once the holdout has scored the recipe (the gate's evidence), the registered base is the same
    # recipe refitted on every row of the window, the holdout's newest rows included (they select nothing:
    # no epoch count or early stop is read from them). False: the base fitted without the holdout ships.
    refit_all_rows: bool = False

    def __post_init__(self):
        _check(self.wide_l2 >= 0, f"base_training.wide_l2 must be >= 0, got {self.wide_l2}")
        _check(
            all(v > 0 for v in self.wide_l2_grid) and (not self.wide_l2_grid or self.wide_l2 > 0),
            f"base_training.wide_l2_grid must hold values > 0 and needs wide_l2 > 0, got {self.wide_l2_grid}",
        )
        _check(
            self.batch_size >= 1 and (self.epochs >= 1 or (self.epochs == 0 and self.wide_l2 > 0)),
            "base_training.batch_size must be >= 1 and epochs >= 1 (0 only with wide_l2 > 0: the LR alone)",
        )
        _check(self.lr > 0, f"base_training.lr must be > 0, got {self.lr}")
        _check(
            self.warmup_steps >= 0 and self.weight_decay >= 0,
            "base_training.warmup_steps and weight_decay must be >= 0",
        )
        _check(0.0 < self.holdout_fraction < 0.5, "base_training.holdout_fraction must be in (0, 0.5)")


@dataclass(frozen=True)
class RegistryConfig:
    base_model_name: str = "ctr_base"
    adapter_model_prefix: str = "ctr_lora_"
    experiment: str = "ctr-lora"

    def __post_init__(self):
        _check(bool(self.base_model_name) and bool(self.adapter_model_prefix), "registry names must be non-empty")


@dataclass(frozen=True)
class LossWeights:
    """The distillation loss (pipelines.training.distill): bce * BCE + kd * T^2 KL + align * align_kind.

    ColdStartConfig keeps them as flat keys (w_bce, w_kd, w_align, temperature, align: the shipped YAML
    and the config hashes use those names) and builds this from them: `ColdStartConfig.loss_weights`.
    """

    bce: float = 1.0
    kd: float = 1.0
    align: float = 0.1
    temperature: float = 2.0
    align_kind: Literal["mse", "cosine"] = "mse"


@dataclass(frozen=True)
class ColdStartConfig(LoraShape):
    """Cold-start adapter distilled from the serving champion (pipelines.training.cold_start).

    The student adapter's shape (r, alpha, target_modules) is a LoraShape, as for the slot adapters."""

    SECTION: ClassVar[str] = "cold_start"
    model_name: str = "ctr_lora_cold_start"  # one adapter for every slot; a single slot run appends _<slot>
    # detection: cold = first seen after the base's cutoff, or < min_impressions before the window
    window_days: int = 60  # the rows cold entities are looked for in (and trained / held out on)
    history_days: int = 180  # how far before the window impressions are counted
    min_impressions: int = 5
    detect_items: bool = True  # items can be cold too (else only users)
    # split: the newest cold users (by their first row in the window) are held out entirely
    holdout_fraction: float = 0.2
    labelled_per_entity: int = 10  # labels used: the first N rows of each cold user / item (0 = all)
    transfer: Literal["cold", "window"] = "cold"  # transfer set: cold rows only, or every row before the holdout
    max_transfer_rows: int = 200000  # newest rows kept when the transfer set is larger
    min_labelled_rows: int = 100
    min_holdout_rows: int = 100
    # student adapter (and r, alpha, target_modules: LoraShape)
    init: Literal["covariance", "default"] = "covariance"  # LoRA A from the user-behaviour covariance
    # the serving base teaches instead of the slot champions when it has the lower logloss on the labelled cold rows
    teacher_fallback: bool = True
    # loss = w_bce * BCE(labelled) + w_kd * T^2 KL(teacher_T || student_T) + w_align * align(pooled)
    w_bce: float = 1.0
    w_kd: float = 3.0
    w_align: float = 0.1
    temperature: float = 2.0
    align: Literal["mse", "cosine"] = "mse"
    # optimisation: one epoch = one pass over the labelled rows, each step also takes a transfer batch
    epochs: int = 10
    batch_size: int = 64
    transfer_batch_size: int = 256
    lr: float = 0.005
    weight_decay: float = 0.0
    warmup_steps: int = 5
    seed: int = 7

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(self.w_bce, self.w_kd, self.w_align, self.temperature, self.align)

    def __post_init__(self):
        super().__post_init__()
        _check(
            "embeddings" not in self.target_modules,
            "cold_start.target_modules cannot name embeddings (only the "
            f"slot adapters may wrap the tables), got {list(self.target_modules)}",
        )
        _check(bool(self.model_name), "cold_start.model_name must be non-empty")
        _check(
            self.window_days >= 1 and self.history_days >= 0,
            "cold_start.window_days must be >= 1 and cold_start.history_days >= 0",
        )
        _check(self.min_impressions >= 0, "cold_start.min_impressions must be >= 0")
        _check(0.0 < self.holdout_fraction < 1.0, "cold_start.holdout_fraction must be in (0, 1)")
        _check(self.labelled_per_entity >= 0, "cold_start.labelled_per_entity must be >= 0 (0 = all rows)")
        _check(self.max_transfer_rows >= 1, "cold_start.max_transfer_rows must be >= 1")
        _check(
            self.min_labelled_rows >= 1 and self.min_holdout_rows >= 1,
            "cold_start.min_labelled_rows and min_holdout_rows must be >= 1",
        )
        _check(
            min(self.w_bce, self.w_kd, self.w_align) >= 0 and self.w_bce + self.w_kd + self.w_align > 0,
            "cold_start.w_bce/w_kd/w_align must be >= 0 and not all 0",
        )
        _check(self.temperature > 0, f"cold_start.temperature must be > 0, got {self.temperature}")
        _check(
            self.epochs >= 1 and self.batch_size >= 1 and self.transfer_batch_size >= 1,
            "cold_start.epochs, batch_size and transfer_batch_size must be >= 1",
        )
        _check(self.lr > 0, f"cold_start.lr must be > 0, got {self.lr}")
        _check(
            self.warmup_steps >= 0 and self.weight_decay >= 0, "cold_start.warmup_steps and weight_decay must be >= 0"
        )


@dataclass(frozen=True)
class PipelineConfig:
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    base_training: BaseTrainConfig = field(default_factory=BaseTrainConfig)
    lora: LoraTrainConfig = field(default_factory=LoraTrainConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)

    def __post_init__(self):
        self._check_family()
        # A rank_pattern key naming a block the model does not have would only fail when the adapter is
        # attached, in the middle of a DAG run: refuse it with the config.
        for key in self.lora.rank_pattern:
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
                _check(
                    int(parts[1]) < self.model.n_blocks,
                    f"lora.rank_pattern key {key!r} names block {parts[1]}, "
                    f"but model.n_blocks is {self.model.n_blocks} (blocks 0..{self.model.n_blocks - 1})",
                )

    def _check_family(self) -> None:
        """The adapters target modules the configured family has; only the default family has the user
        table x embed_dim layout the cold-start covariance init reads (training.distill)."""
        fam = self.model.family
        allowed = ModelConfig.FAMILY_TARGETS.get(fam)
        if allowed is None:
            return
        # `embeddings` (every field table) only for the slot adapters: the student wraps the names as given
        tables = fam != "minilm_text"  # the text family has no field tables: no `embeddings`, no id rows
        _check(
            tables or not self.lora.trainable_tokens,
            f"lora.trainable_tokens names id tables, which model.family {fam!r} does not have; set it to []",
        )
        for section, targets, extra in (
            ("lora", self.lora.target_modules, {"embeddings"} if tables else set()),
            ("cold_start", self.cold_start.target_modules, set()),
        ):
            wrong = sorted(set(targets) - allowed - extra)
            _check(
                not wrong,
                f"{section}.target_modules {wrong} are not modules of model.family {fam!r} "
                f"(choose from {sorted(allowed)})",
            )
        _check(
            fam != "dcn" or not self.lora.layers,
            "lora.layers: dcn's cross and deep layers are two lists, "
            f"not one; wrap modules by name (lora.target_modules) instead, got {list(self.lora.layers)}",
        )
        blocks = self.model.n_blocks
        _check(
            fam != "feature_transformer" or all(-blocks <= i < blocks for i in self.lora.layers),
            f"lora.layers {list(self.lora.layers)}: the model has {blocks} blocks (0..{blocks - 1} or -{blocks}..-1)",
        )
        _check(
            fam == "feature_transformer" or self.cold_start.init != "covariance",
            f"cold_start.init: covariance needs the feature_transformer family; with model.family {fam!r} "
            "set cold_start.init: default",
        )

    def adapter_model_name(self, slot: str) -> str:
        return f"{self.registry.adapter_model_prefix}{slot}"


def load_pipeline_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> PipelineConfig:
    """Load the pipeline config: file (default: $CTR_PIPELINE_CONFIG or configs/pipeline.yaml) + overrides."""
    path = path or os.environ.get("CTR_PIPELINE_CONFIG") or DEFAULT_PIPELINE_YAML
    return from_dict(PipelineConfig, deep_merge(read_yaml(path), overrides or {}), where=str(path))


def to_dict(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_hash(cfg) -> str:
    """Stable sha256 of a config: part of every registered version's lineage."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()
