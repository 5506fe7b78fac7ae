"""`lora` of configs/pipeline.yaml: what a slot adapter is made of and how it trains (a LoRA recipe or a per-id
delta), as typed, validated dataclasses. Re-exported by pipelines.config, where callers import it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipelines.config_loader import check as _check


@dataclass(frozen=True)
class LoraShape:
    """What an adapter is made of, shared by the slot adapters (`lora`) and the cold-start student
    (`cold_start`): rank, alpha (LoRA scale = alpha / r) and the modules PEFT wraps. Dropout (only
    `lora`) and the A init (only `cold_start`) are training choices of one recipe, so they stay there."""

    SECTION: ClassVar[str] = "adapter"  # the YAML section, for error messages
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        s = self.SECTION
        _check(self.r >= 1 and self.alpha >= 1, f"{s}.r and {s}.alpha must be >= 1, got {self.r}/{self.alpha}")
        # Which names exist depends on model.family: PipelineConfig checks them (a user's family: PEFT does).
        _check(
            len(self.target_modules) > 0
            and all(isinstance(t, str) and t.strip(".") and " " not in t for t in self.target_modules),
            f"{s}.target_modules must be a non-empty list of module names, got {list(self.target_modules)}",
        )


@dataclass(frozen=True)
class LoraTrainConfig(LoraShape):
    SECTION: ClassVar[str] = "lora"
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
    early_stopping_patience: int = 2  # epochs without val-logloss improvement; 0 disables
    # The untrained adapter (the base itself) competes as epoch 0 in early stopping: an adapter whose every
    # epoch scores a worse val logloss than the base ends as a zero update instead of the least bad epoch.
    keep_base_if_no_gain: bool = False
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
    # Per-layer ranks (PEFT rank_pattern): {module name, e.g. blocks.1.v_proj or v_proj: rank}; modules
    # not named keep `r`, and each keeps alpha / its rank as its scale. Empty: `r` everywhere.
    rank_pattern: dict = field(default_factory=dict)
    # The layers whose target modules LoRA wraps, by index (PEFT layers_to_transform); negative ones count from
    # the top, so [-1] is the top layer whatever the depth. Empty: every layer. For families whose layers are one
    # numbered list (the feature transformer's `blocks.N`, the text transformer's `encoder.layer.N`); not dcn.
    layers: tuple[int, ...] = ()
    # lambda of the orthogonality penalty: the loss gains lambda * sum_j ||dW^T dW_j||_F over the target
    # modules and the serving champions j of the other slots (training.orthogonality). 0: off.
    orthogonality_lambda: float = 0.0
    # What the adapter changes (docs/architecture.md, "Model"). lora: low-rank updates of
    # target_modules (and the id rows of trainable_tokens). delta: per-id additive offsets of the logit, the
    # rows of the base's wide term (model.wide) for the window's ids of trainable_tokens, anchored to zero by
    # delta_l2 (its penalty is delta_l2 / 2 * ||offsets||^2 over the sum of the rows' log-losses: 1 / C of an
    # LR) and trained with per-coordinate adaptive steps (Adagrad); the LoRA matrices stay at zero.
    kind: Literal["lora", "delta"] = "lora"
    delta_l2: float = 10.0
    # The rows a slot's adapter trains on (and is held out and evaluated on): its slot's, or every slot's rows
    # of the window (each slot's adapter then learns the same per-id offsets; chosen on the validation days for
    # the delta kind, docs/benchmarks.md).
    train_rows: Literal["slot", "all"] = "slot"
    # Where a candidate is judged (docs/architecture.md, "The prequential gate"). holdout: its window's newest
    # `holdout_fraction` of rows is held out and the gate decides as soon as it is registered. next_day: it
    # trains on every row of its window, the newest day included, and waits: each later validated day's rows
    # of its slot judge it beside the champion (promotion.prequential), until the policy's sequential test
    # decides. holdout_fraction is not used then.
    judged_on: Literal["holdout", "next_day"] = "holdout"

    @property
    def max_rank(self) -> int:
        """The largest rank of any wrapped module: what the stability rule bounds."""
        return max([self.r, *self.rank_pattern.values()])

    @property
    def stability(self) -> float:
        """lr * r / sqrt(batch_size): the rule's left-hand side (r: the largest rank in use)."""
        return self.lr * self.max_rank / self.batch_size**0.5

    def stable_lr(self) -> float:
        """The lr that training uses: `lr`, or the largest lr that satisfies the rule ("rescale"). The rule
        bounds LoRA updates: a `delta` adapter trains no LoRA matrix, so its lr is `lr`."""
        if self.kind == "delta" or self.stability <= self.stability_max:
            return self.lr
        return self.stability_max * self.batch_size**0.5 / self.max_rank

    def __post_init__(self):
        super().__post_init__()
        _check(0.0 <= self.dropout < 1.0, "lora.dropout must be in [0, 1)")
        _check(self.epochs >= 1 and self.batch_size >= 1, "lora.epochs and lora.batch_size must be >= 1")
        _check(self.lr > 0, f"lora.lr must be > 0, got {self.lr}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0, "lora.warmup_steps and weight_decay must be >= 0")
        _check(self.window_days >= 1, "lora.window_days must be >= 1")
        _check(0.0 < self.holdout_fraction < 0.5, "lora.holdout_fraction must be in (0, 0.5)")
        _check(0.0 <= self.val_fraction < 0.5, f"lora.val_fraction must be in [0, 0.5), got {self.val_fraction}")
        _check(
            set(self.trainable_tokens) <= set(self.TOKEN_TABLES)
            and "embeddings" not in self.target_modules
            or not self.trainable_tokens,
            f"lora.trainable_tokens must name tables of {list(self.TOKEN_TABLES)} "
            f"and cannot be combined with LoRA on the embeddings, got {list(self.trainable_tokens)}",
        )
        _check(
            not self.tokens_only or bool(self.trainable_tokens),
            "lora.tokens_only needs lora.trainable_tokens: with no id rows an adapter would train nothing",
        )
        _check(self.kind in ("lora", "delta"), f"lora.kind must be lora or delta, got {self.kind!r}")
        _check(self.train_rows in ("slot", "all"), f"lora.train_rows must be slot or all, got {self.train_rows!r}")
        _check(
            self.judged_on in ("holdout", "next_day"),
            f"lora.judged_on must be holdout or next_day, got {self.judged_on!r}",
        )
        _check(
            self.kind != "delta" or bool(self.trainable_tokens),
            "lora.kind delta needs lora.trainable_tokens: the id tables whose per-id offsets train",
        )
        _check(self.delta_l2 >= 0, f"lora.delta_l2 must be >= 0, got {self.delta_l2}")
        _check(
            self.early_stopping_patience >= 0,
            f"lora.early_stopping_patience must be >= 0 (0 disables), got {self.early_stopping_patience}",
        )
        _check(self.stability_max > 0, f"lora.stability_max must be > 0, got {self.stability_max}")
        self._check_rank_pattern()
        _check(
            all(isinstance(i, int) and not isinstance(i, bool) for i in self.layers)
            and len(set(self.layers)) == len(self.layers),
            f"lora.layers must be distinct layer indices (-1: the top layer), got {list(self.layers)}",
        )
        _check(
            self.orthogonality_lambda >= 0, f"lora.orthogonality_lambda must be >= 0, got {self.orthogonality_lambda}"
        )

        _check(
            self.stability_action != "reject" or self.kind == "delta" or self.stability <= self.stability_max,
            f"lora: lr * r / sqrt(batch_size) = {self.lr:g} * {self.max_rank} / sqrt({self.batch_size}) = "
            f"{self.stability:.6g} exceeds stability_max = {self.stability_max:g} (LoRA training was measured "
            f"to collapse above it). Fix: lower lora.lr to <= {self.stable_lr():.6g}, or raise "
            f"lora.batch_size to >= {math.ceil((self.lr * self.max_rank / self.stability_max) ** 2)} "
            "(or set stability_action: rescale)",
        )

    def _check_rank_pattern(self) -> None:
        """Keys are dotted module names ending in a target module (PEFT matches them as name suffixes; a
        key that matches no module is refused when the adapter is attached), values ranks >= 1."""
        rp = self.rank_pattern
        _check(isinstance(rp, dict), f"lora.rank_pattern must be a mapping of module name to rank, got {rp!r}")
        wrapped = set(self.target_modules) - {"embeddings"}
        for key, rank in rp.items():
            _check(
                isinstance(key, str)
                and (
                    key.rsplit(".", 1)[-1] in wrapped
                    or "embeddings" in self.target_modules
                    and key.startswith("embeddings.")
                ),
                f"lora.rank_pattern key {key!r} must name a module of lora.target_modules {sorted(wrapped)} "
                "(e.g. blocks.1.v_proj)",
            )
            _check(
                isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1,
                f"lora.rank_pattern[{key!r}] must be an integer rank >= 1, got {rank!r}",
            )
