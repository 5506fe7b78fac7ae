"""One typed config dataclass per stage, validated in __post_init__, loaded from YAML.

Unknown keys are rejected (a typo in a YAML file must not silently fall back to a default): the
loader is pipelines.config_loader.
`configs/pipeline.yaml` holds the sections below; `configs/gate_policy.yaml` holds GatePolicy.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from pipelines.config_loader import check as _check, deep_merge, from_dict, read_yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PIPELINE_YAML = REPO_ROOT / "configs" / "pipeline.yaml"
DEFAULT_GATE_YAML = REPO_ROOT / "configs" / "gate_policy.yaml"


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
            _check(isinstance(lake, str) and (lake.startswith(("s3://", "/", "./", "file://")) or "://" not in lake),
                   f"data.lake_uri and data.allowed_lakes must be s3:// URIs or local paths, got {lake!r}")
        _check(len(self.slots) > 0 and len(set(self.slots)) == len(self.slots),
               f"data.slots must be a non-empty list of distinct names, got {list(self.slots)}")

    def lakes(self) -> tuple[str, ...]:
        """Every lake a run may read: lake_uri, then allowed_lakes."""
        return tuple(dict.fromkeys((self.lake_uri, *self.allowed_lakes)))

    def checked_lake(self, lake: str | None) -> str:
        """`lake` when it is one of `lakes()` (a trailing / aside), lake_uri for None; else ConfigError."""
        found = [k for k in self.lakes() if not lake or str(lake).rstrip("/") == k.rstrip("/")]
        _check(bool(found), f"lake {lake!r} is not allowed: a run may read data.lake_uri ({self.lake_uri}) or a "
                            f"lake listed in data.allowed_lakes ({list(self.allowed_lakes)}) of the pipeline config")
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

    def __post_init__(self):
        _check(0.0 <= self.label_rate_min < self.label_rate_max <= 1.0,
               f"validation.label_rate_min/max must satisfy 0 <= min < max <= 1, got "
               f"{self.label_rate_min}/{self.label_rate_max}")
        _check(self.min_rows >= 1, f"validation.min_rows must be >= 1, got {self.min_rows}")
        _check(self.label_rate_min_rows >= 0, "validation.label_rate_min_rows must be >= 0")
        _check(0.0 <= self.max_null_fraction_side <= 1.0, "validation.max_null_fraction_side must be in [0, 1]")
        _check(self.max_id_length >= 1, "validation.max_id_length must be >= 1")
        _check(0.0 <= self.max_duplicate_fraction < 1.0, "validation.max_duplicate_fraction must be in [0, 1)")
        _check(self.reference_partitions >= 1, "validation.reference_partitions must be >= 1")
        _check(0.0 <= self.volume_ratio_min <= 1.0 <= self.volume_ratio_max,
               f"validation.volume_ratio_min/max must satisfy 0 <= min <= 1 <= max, got "
               f"{self.volume_ratio_min}/{self.volume_ratio_max}")
        _check(0.0 < self.label_rate_rel_tolerance, "validation.label_rate_rel_tolerance must be > 0")
        _check(self.label_rate_z >= 0.0, "validation.label_rate_z must be >= 0")
        _check(self.drift_psi_max > 0 and self.drift_numeric_psi_max > 0, "validation.drift_*_max must be > 0")
        _check(self.drift_min_rows >= 0, "validation.drift_min_rows must be >= 0")


@dataclass(frozen=True)
class ModelConfig:
    embed_dim: int = 32
    n_blocks: int = 2
    n_heads: int = 4
    ffn_mult: int = 2
    dropout: float = 0.0
    id_buckets: int = 1 << 14
    small_buckets: int = 64
    # First-order ("wide") term: one learned bias per field value (an Embedding of dim 1 per field,
    # zero-initialised), summed into the logit as in Wide&Deep / DeepFM. False = the original model
    # (same state_dict keys, same weights for a seed).
    wide: bool = False

    def __post_init__(self):
        _check(self.n_heads >= 1 and self.embed_dim > 0 and self.embed_dim % self.n_heads == 0,
               f"model.embed_dim ({self.embed_dim}) must be a positive multiple of model.n_heads ({self.n_heads})")
        _check(self.n_blocks >= 1, "model.n_blocks must be >= 1")
        _check(self.ffn_mult >= 1, "model.ffn_mult must be >= 1")
        _check(0.0 <= self.dropout < 1.0, "model.dropout must be in [0, 1)")
        _check(self.id_buckets >= 2 and self.small_buckets >= 2, "model.*_buckets must be >= 2")
        _check(isinstance(self.wide, bool), f"model.wide must be true or false, got {self.wide!r}")


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

    def __post_init__(self):
        _check(self.epochs >= 1 and self.batch_size >= 1, "base_training.epochs and batch_size must be >= 1")
        _check(self.lr > 0, f"base_training.lr must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0,
               "base_training.warmup_steps and weight_decay must be >= 0")
        _check(0.0 < self.holdout_fraction < 0.5, "base_training.holdout_fraction must be in (0, 0.5)")


@dataclass(frozen=True)
class LoraShape:
    """What an adapter is made of, shared by the slot adapters (`lora`) and the cold-start student
    (`cold_start`): rank, alpha (LoRA scale = alpha / r) and the modules PEFT wraps. Dropout (only
    `lora`) and the A init (only `cold_start`) are training choices of one recipe, so they stay there."""
    SECTION: ClassVar[str] = "adapter"   # the YAML section, for error messages
    TARGETS: ClassVar[frozenset[str]] = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        s = self.SECTION
        _check(self.r >= 1 and self.alpha >= 1, f"{s}.r and {s}.alpha must be >= 1, got {self.r}/{self.alpha}")
        _check(len(self.target_modules) > 0 and set(self.target_modules) <= self.TARGETS,
               f"{s}.target_modules must be a non-empty subset of {sorted(self.TARGETS)}, "
               f"got {list(self.target_modules)}")


@dataclass(frozen=True)
class LoraTrainConfig(LoraShape):
    SECTION: ClassVar[str] = "lora"
    TARGETS: ClassVar[frozenset[str]] = LoraShape.TARGETS | {"embeddings"}  # embeddings: every field table
    dropout: float = 0.0
    epochs: int = 3
    batch_size: int = 256
    lr: float = 5e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    window_days: int = 28
    holdout_fraction: float = 0.2
    min_rows: int = 200
    seed: int = 7
    # LayerNorm biases of the frozen base train with the adapter (saved next to it, see model.adapters).
    train_layernorm_bias: bool = False
    # Validation split for early stopping: the newest rows of the training part (the evaluation
    # holdout stays untouched). 0 disables validation and early stopping.
    val_fraction: float = 0.1
    early_stopping_patience: int = 2   # epochs without val-logloss improvement; 0 disables
    # Stability rule lr * r / sqrt(batch_size) <= stability_max; the default and the evidence for
    # it: docs/benchmarks.md, "LoRA learning-rate stability rule".
    stability_max: float = 0.01
    stability_action: Literal["rescale", "reject"] = "rescale"
    # Id tables whose rows train with the adapter, for the ids the caller names (PEFT
    # trainable_token_indices; with the base's wide term, `wide.<table>` too): what lets an adapter
    # learn users and items the frozen base never saw (issue 14). Empty: off.
    trainable_tokens: tuple[str, ...] = ()
    # Only those id rows train; the LoRA matrices keep their zero start (a no-op). In the backtest,
    # LoRA on q/v trained with the rows cost cold users' AUC (docs/benchmarks.md, "Backtest").
    tokens_only: bool = False
    TOKEN_TABLES: ClassVar[tuple[str, ...]] = ("user_id", "item_id")

    @property
    def stability(self) -> float:
        """lr * r / sqrt(batch_size): the rule's left-hand side."""
        return self.lr * self.r / self.batch_size ** 0.5

    def stable_lr(self) -> float:
        """The lr that training uses: `lr`, or the largest lr that satisfies the rule ("rescale")."""
        if self.stability <= self.stability_max:
            return self.lr
        return self.stability_max * self.batch_size ** 0.5 / self.r

    def __post_init__(self):
        super().__post_init__()
        _check(0.0 <= self.dropout < 1.0, "lora.dropout must be in [0, 1)")
        _check(self.epochs >= 1 and self.batch_size >= 1, "lora.epochs and lora.batch_size must be >= 1")
        _check(self.lr > 0, f"lora.lr must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0, "lora.warmup_steps and weight_decay must be >= 0")
        _check(self.window_days >= 1, "lora.window_days must be >= 1")
        _check(0.0 < self.holdout_fraction < 0.5, "lora.holdout_fraction must be in (0, 0.5)")
        _check(0.0 <= self.val_fraction < 0.5, f"lora.val_fraction must be in [0, 0.5), got {self.val_fraction}")
        _check(set(self.trainable_tokens) <= set(self.TOKEN_TABLES) and "embeddings" not in self.target_modules
               or not self.trainable_tokens, f"lora.trainable_tokens must name tables of {list(self.TOKEN_TABLES)} "
               f"and cannot be combined with LoRA on the embeddings, got {list(self.trainable_tokens)}")
        _check(not self.tokens_only or bool(self.trainable_tokens),
               "lora.tokens_only needs lora.trainable_tokens: with no id rows an adapter would train nothing")
        _check(self.early_stopping_patience >= 0,
               f"lora.early_stopping_patience must be >= 0 (0 disables), got {self.early_stopping_patience}")
        _check(self.stability_max > 0, f"lora.stability_max must be > 0, got {self.stability_max}")
        import math  # local: this class is the only user

        _check(self.stability_action != "reject" or self.stability <= self.stability_max,
               f"lora: lr * r / sqrt(batch_size) = {self.lr:g} * {self.r} / sqrt({self.batch_size}) = "
               f"{self.stability:.6g} exceeds stability_max = {self.stability_max:g} (LoRA training was measured "
               f"to collapse above it). Fix: lower lora.lr to <= {self.stable_lr():.6g}, or raise "
               f"lora.batch_size to >= {math.ceil((self.lr * self.r / self.stability_max) ** 2)} "
               "(or set stability_action: rescale)")


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
    model_name: str = "ctr_lora_cold_start"   # one adapter for every slot; a single slot run appends _<slot>
    # detection: cold = first seen after the base's cutoff, or < min_impressions before the window
    window_days: int = 60            # the rows cold entities are looked for in (and trained / held out on)
    history_days: int = 180          # how far before the window impressions are counted
    min_impressions: int = 5
    detect_items: bool = True        # items can be cold too (else only users)
    # split: the newest cold users (by their first row in the window) are held out entirely
    holdout_fraction: float = 0.2
    labelled_per_entity: int = 10    # labels used: the first N rows of each cold user / item (0 = all)
    transfer: Literal["cold", "window"] = "cold"   # transfer set: cold rows only, or every row before the holdout
    max_transfer_rows: int = 200000  # newest rows kept when the transfer set is larger
    min_labelled_rows: int = 100
    min_holdout_rows: int = 100
    # student adapter (and r, alpha, target_modules: LoraShape)
    init: Literal["covariance", "default"] = "covariance"   # LoRA A from the user-behaviour covariance
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
        _check(bool(self.model_name), "cold_start.model_name must be non-empty")
        _check(self.window_days >= 1 and self.history_days >= 0,
               "cold_start.window_days must be >= 1 and cold_start.history_days >= 0")
        _check(self.min_impressions >= 0, "cold_start.min_impressions must be >= 0")
        _check(0.0 < self.holdout_fraction < 1.0, "cold_start.holdout_fraction must be in (0, 1)")
        _check(self.labelled_per_entity >= 0, "cold_start.labelled_per_entity must be >= 0 (0 = all rows)")
        _check(self.max_transfer_rows >= 1, "cold_start.max_transfer_rows must be >= 1")
        _check(self.min_labelled_rows >= 1 and self.min_holdout_rows >= 1,
               "cold_start.min_labelled_rows and min_holdout_rows must be >= 1")
        _check(min(self.w_bce, self.w_kd, self.w_align) >= 0 and self.w_bce + self.w_kd + self.w_align > 0,
               "cold_start.w_bce/w_kd/w_align must be >= 0 and not all 0")
        _check(self.temperature > 0, f"cold_start.temperature must be > 0, got {self.temperature}")
        _check(self.epochs >= 1 and self.batch_size >= 1 and self.transfer_batch_size >= 1,
               "cold_start.epochs, batch_size and transfer_batch_size must be >= 1")
        _check(self.lr > 0, f"cold_start.lr must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0,
               "cold_start.warmup_steps and weight_decay must be >= 0")


@dataclass(frozen=True)
class PipelineConfig:
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    base_training: BaseTrainConfig = field(default_factory=BaseTrainConfig)
    lora: LoraTrainConfig = field(default_factory=LoraTrainConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)

    def adapter_model_name(self, slot: str) -> str:
        return f"{self.registry.adapter_model_prefix}{slot}"


@dataclass(frozen=True)
class GatePolicy:
    """configs/gate_policy.yaml: what a candidate must show against the serving @champion, and how a
    passing one is released (canary, approval) and watched afterwards (pipelines.promotion.monitor)."""
    # non-inferiority against the serving champion, on the same holdout rows
    auc_tolerance: float = 0.0015          # candidate AUC >= champion AUC - this
    logloss_tolerance: float = 0.005       # candidate logloss <= champion logloss + this
    superiority: bool = False              # also require DeLong: AUC difference > 0 with p < superiority_alpha
    superiority_alpha: float = 0.05
    slot_auc_tolerance: float = 0.005      # per slot (slots with enough rows): candidate >= champion - this
    slot_tolerances: dict = field(default_factory=dict)   # {slot: tolerance} overrides slot_auc_tolerance
    # absolute checks, every run (first runs: only these)
    min_auc_first_run: float = 0.6
    # every run: below this AUC on its holdout a candidate is never released, whatever the champion scores
    # there (a day of flipped labels makes both score below 0.5 and the relative checks pass; the backtest's fault)
    min_auc: float = 0.5
    max_logloss_first_run: float = 0.75
    max_demographic_parity_gap: float = 0.2    # max gap in mean pCTR between gender / age groups
    max_equalized_odds_gap: float = 0.4        # max TPR / FPR gap at the serving threshold
    calibration_min: float = 0.5               # mean pCTR / observed CTR within [min, max]
    calibration_max: float = 1.5
    latency_budget_ms: float = 250.0           # p99 of the pyfunc at batch 32
    # Checks that pass when the evaluation could not measure them; any other unmeasured check FAILS.
    # An entry is a check's family (`slot_auc`: every slot) or one check (`slot_auc[night]`).
    optional_checks: tuple[str, ...] = ()
    # release
    promotion: Literal["canary", "direct"] = "canary"
    canary_share: float = 0.1                  # share of users (hash of user_id) served by @canary
    # A candidate that passes while an earlier canary is still being watched: `hold` (it stays gated, not
    # released; a later retrain releases once the canary is promoted or withdrawn) or `replace` it. With
    # daily retrains `replace` restarts the watch every day, so no canary ever reached canary_healthy_windows
    # in the backtest's replay (docs/benchmarks.md).
    canary_in_flight: Literal["hold", "replace"] = "hold"
    approval: bool = False                     # a human approves (Airflow HITL) before the release
    # after release: ctr_champion_monitor, one window = one newly validated daily partition
    canary_healthy_windows: int = 3            # canary no worse than the champion this many windows => champion
    canary_auc_tolerance: float = 0.005        # "worse beyond tolerance": canary AUC < champion AUC - this
    revert_metric: Literal["auc", "ctr"] = "auc"
    revert_drop: float = 0.15                  # relative drop of the champion's metric vs its reference ...
    revert_windows: int = 3                    # ... for this many consecutive windows => auto-revert
    live_metrics_url: str = ""                 # Prometheus HTTP API base URL ("" = labelled partitions only)

    # The gate checks that can go unmeasured (promotion.gate): only these may be listed as optional.
    # Base compatibility, the AUC / logloss checks and DeLong superiority fail when unmeasured, always.
    OPTIONAL_CHECK_FAMILIES: ClassVar[tuple[str, ...]] = (
        "fairness", "fairness_dp", "fairness_eo", "calibration", "latency_p99_batch32_ms", "slot_auc")

    def __post_init__(self):
        # A YAML list or a list given in code: stored as a tuple (the policy is frozen and hashable).
        object.__setattr__(self, "optional_checks", tuple(self.optional_checks))
        _check(all(isinstance(n, str) and n.split("[", 1)[0] in self.OPTIONAL_CHECK_FAMILIES
                   and ("[" not in n or (n.endswith("]") and len(n) > n.index("[") + 2)) for n in self.optional_checks),
               f"gate.optional_checks must name checks of {list(self.OPTIONAL_CHECK_FAMILIES)} (a family, or one "
               f"check such as slot_auc[night]), got {list(self.optional_checks)}")
        _check(0.0 <= self.auc_tolerance < 0.5, f"gate.auc_tolerance must be in [0, 0.5), got {self.auc_tolerance}")
        _check(self.logloss_tolerance >= 0, "gate.logloss_tolerance must be >= 0")
        _check(0.0 < self.superiority_alpha < 1.0, "gate.superiority_alpha must be in (0, 1)")
        _check(0.0 <= self.slot_auc_tolerance < 0.5, "gate.slot_auc_tolerance must be in [0, 0.5)")
        _check(isinstance(self.slot_tolerances, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 0.5
            for k, v in self.slot_tolerances.items()),
            f"gate.slot_tolerances must map slot names to tolerances in [0, 0.5), got {self.slot_tolerances!r}")
        _check(0.0 <= self.min_auc_first_run <= 1.0 and 0.0 <= self.min_auc <= 1.0,
               "gate.min_auc_first_run and gate.min_auc must be in [0, 1]")
        _check(self.max_logloss_first_run > 0, "gate.max_logloss_first_run must be > 0")
        _check(0 < self.max_demographic_parity_gap <= 1 and 0 < self.max_equalized_odds_gap <= 1,
               "gate.max_demographic_parity_gap and max_equalized_odds_gap must be in (0, 1]")
        _check(0 < self.calibration_min < 1 < self.calibration_max,
               f"gate.calibration_min/max must satisfy 0 < min < 1 < max, got {self.calibration_min}/{self.calibration_max}")
        _check(self.latency_budget_ms > 0, "gate.latency_budget_ms must be > 0")
        _check(0.0 < self.canary_share < 1.0, f"gate.canary_share must be in (0, 1), got {self.canary_share}")
        _check(self.canary_healthy_windows >= 1 and self.revert_windows >= 1,
               "gate.canary_healthy_windows and revert_windows must be >= 1")
        _check(0 <= self.canary_auc_tolerance < 0.5, "gate.canary_auc_tolerance must be in [0, 0.5)")
        _check(0 < self.revert_drop < 1, f"gate.revert_drop must be in (0, 1), got {self.revert_drop}")
        _check(self.live_metrics_url == "" or self.live_metrics_url.startswith(("http://", "https://")),
               f"gate.live_metrics_url must be empty or an http(s) URL, got {self.live_metrics_url!r}")

    def slot_tolerance(self, slot: str) -> float:
        return float(self.slot_tolerances.get(slot, self.slot_auc_tolerance))

    def is_optional(self, check: str) -> bool:
        """Whether the check `check` (e.g. `slot_auc[night]`) may pass unmeasured: it or its family is listed."""
        return check in self.optional_checks or check.split("[", 1)[0] in self.optional_checks


# ---------------------------------------------------------------- loading


def load_pipeline_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> PipelineConfig:
    """Load the pipeline config: file (default: $CTR_PIPELINE_CONFIG or configs/pipeline.yaml) + overrides."""
    path = path or os.environ.get("CTR_PIPELINE_CONFIG") or DEFAULT_PIPELINE_YAML
    return from_dict(PipelineConfig, deep_merge(read_yaml(path), overrides or {}), where=str(path))


def load_gate_policy(path: str | os.PathLike | None = None, overrides: dict | None = None) -> GatePolicy:
    path = path or os.environ.get("CTR_GATE_POLICY") or DEFAULT_GATE_YAML
    return from_dict(GatePolicy, deep_merge(read_yaml(path), overrides or {}), where=str(path))


def to_dict(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_hash(cfg) -> str:
    """Stable sha256 of a config: part of every registered version's lineage."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()
