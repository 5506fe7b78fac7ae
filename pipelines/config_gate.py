"""configs/gate_policy.yaml as a typed, validated dataclass: what the promotion gate, the release and
the champion monitor read (`pipelines.promotion`). Re-exported by pipelines.config, where callers import it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from pipelines.config_loader import check as _check, deep_merge, from_dict, read_yaml

DEFAULT_GATE_YAML = Path(__file__).resolve().parent.parent / "configs" / "gate_policy.yaml"


@dataclass(frozen=True)
class GatePolicy:
    """configs/gate_policy.yaml: what a candidate must show against the serving @champion, and how a
    passing one is released (canary, approval) and watched afterwards (pipelines.promotion.monitor)."""

    # non-inferiority against the serving champion, on the same holdout rows
    auc_tolerance: float = 0.0015  # candidate AUC >= champion AUC - this
    logloss_tolerance: float = 0.005  # candidate logloss <= champion logloss + this
    superiority: bool = False  # also require DeLong: AUC difference > 0 with p < superiority_alpha
    superiority_alpha: float = 0.05
    slot_auc_tolerance: float = 0.005  # per slot (slots with enough rows): candidate >= champion - this
    slot_tolerances: dict = field(default_factory=dict)  # {slot: tolerance} overrides slot_auc_tolerance
    # absolute checks, every run (first runs: only these)
    min_auc_first_run: float = 0.6
    # every run: below this AUC on its holdout a candidate is never released, whatever the champion scores
    # there (a day of flipped labels makes both score below 0.5 and the relative checks pass; the backtest's fault)
    min_auc: float = 0.5
    max_logloss_first_run: float = 0.75
    max_demographic_parity_gap: float = 0.2  # max gap in mean pCTR between gender / age groups
    max_equalized_odds_gap: float = 0.4  # max TPR / FPR gap at the serving threshold
    calibration_min: float = 0.5  # mean pCTR / observed CTR within [min, max]
    calibration_max: float = 1.5
    latency_budget_ms: float = 250.0  # p99 of the pyfunc at batch 32
    # Largest |cos| between a candidate adapter's update and the other slots' champions' (evaluation
    # interference); None: not checked. The replay measured 0.29-0.97 without the orthogonality penalty
    # (docs/history.md), so a bound needs lora.orthogonality_lambda too.
    max_interference_cos: float | None = None
    # Checks that pass when the evaluation could not measure them; any other unmeasured check FAILS.
    # An entry is a check's family (`slot_auc`: every slot) or one check (`slot_auc[night]`).
    optional_checks: tuple[str, ...] = ()
    # release
    promotion: Literal["canary", "direct"] = "canary"
    canary_share: float = 0.1  # share of users (hash of user_id) served by @canary
    # A candidate that passes while an earlier canary is still being watched: `hold` (it stays gated, not
    # released; a later retrain releases once the canary is promoted or withdrawn) or `replace` it. With
    # daily retrains `replace` restarts the watch every day, so no canary ever reached canary_healthy_windows
    # in the backtest's replay (docs/benchmarks.md).
    canary_in_flight: Literal["hold", "replace"] = "hold"
    approval: bool = False  # a human approves (Airflow HITL) before the release
    # after release: ctr_champion_monitor, one window = one newly validated daily partition
    canary_healthy_windows: int = 3  # canary no worse than the champion this many windows => champion
    canary_auc_tolerance: float = 0.005  # "worse beyond tolerance": canary AUC < champion AUC - this
    revert_metric: Literal["auc", "ctr"] = "auc"
    revert_drop: float = 0.15  # relative drop of the champion's metric vs its reference ...
    revert_windows: int = 3  # ... for this many consecutive windows => auto-revert
    live_metrics_url: str = ""  # Prometheus HTTP API base URL ("" = labelled partitions only)
    # The prequential gate (lora.judged_on: next_day; promotion.sequential): a waiting candidate's evidence is the
    # paired per-row logloss difference champion - candidate over the days it waits, bounded by a confidence
    # sequence valid at every daily look. release: lower bound > -judge_margin (and > judge_min_effect when set);
    # reject: upper bound < -judge_margin, or still undecided after judge_max_wait_days judged days.
    judge_alpha: float = 0.1
    judge_margin: float = 0.0  # logloss per row: how much worse a fresher candidate may be
    judge_min_effect: float | None = None  # None: non-inferiority; a number: the lower bound must clear it too
    judge_planned_rows: int = 1000  # the confidence sequence is tightest near this many judged rows
    judge_min_rows: int = 100  # fewer judged rows than this: no decision yet
    judge_max_wait_days: int = 2  # judged days before an undecided candidate is retired
    # What a release verdict releases: the judged candidate itself (`judged`: it serves a day after it was
    # judged, two after its window), or its successor (`successor`: the candidate the same evening trained,
    # same slot, config and base, its window one day newer, gated on its predecessor's judgement plus its own
    # base check), so that what serves is as fresh as a release without a gate (docs/benchmarks.md).
    judge_release: Literal["judged", "successor"] = "judged"
    # Who carries the burden of proof. `candidate`: a release needs evidence that the fresher model is no worse
    # than the margin (the lower bound clears it; undecided waits). `champion`: a fresher model that passes the
    # safety checks on at least judge_min_rows rows is released unless the evidence shows it worse beyond the
    # margin (the upper bound below it): freshness is presumed to help, and harm must be shown.
    judge_burden: Literal["candidate", "champion"] = "candidate"

    # The gate checks that can go unmeasured (promotion.gate): only these may be listed as optional.
    # Base compatibility, the AUC / logloss checks and DeLong superiority fail when unmeasured, always.
    OPTIONAL_CHECK_FAMILIES: ClassVar[tuple[str, ...]] = (
        "fairness",
        "fairness_dp",
        "fairness_eo",
        "calibration",
        "latency_p99_batch32_ms",
        "slot_auc",
        "interference",
    )

    def __post_init__(self):
        # A YAML list or a list given in code: stored as a tuple (the policy is frozen and hashable).
        object.__setattr__(self, "optional_checks", tuple(self.optional_checks))
        _check(
            all(
                isinstance(n, str)
                and n.split("[", 1)[0] in self.OPTIONAL_CHECK_FAMILIES
                and ("[" not in n or (n.endswith("]") and len(n) > n.index("[") + 2))
                for n in self.optional_checks
            ),
            f"gate.optional_checks must name checks of {list(self.OPTIONAL_CHECK_FAMILIES)} (a family, or one "
            f"check such as slot_auc[night]), got {list(self.optional_checks)}",
        )
        _check(0.0 <= self.auc_tolerance < 0.5, f"gate.auc_tolerance must be in [0, 0.5), got {self.auc_tolerance}")
        _check(self.logloss_tolerance >= 0, "gate.logloss_tolerance must be >= 0")
        _check(0.0 < self.superiority_alpha < 1.0, "gate.superiority_alpha must be in (0, 1)")
        _check(0.0 <= self.slot_auc_tolerance < 0.5, "gate.slot_auc_tolerance must be in [0, 0.5)")
        _check(
            isinstance(self.slot_tolerances, dict)
            and all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 0.5
                for k, v in self.slot_tolerances.items()
            ),
            f"gate.slot_tolerances must map slot names to tolerances in [0, 0.5), got {self.slot_tolerances!r}",
        )
        _check(
            0.0 <= self.min_auc_first_run <= 1.0 and 0.0 <= self.min_auc <= 1.0,
            "gate.min_auc_first_run and gate.min_auc must be in [0, 1]",
        )
        _check(self.max_logloss_first_run > 0, "gate.max_logloss_first_run must be > 0")
        _check(
            self.max_interference_cos is None
            or isinstance(self.max_interference_cos, (int, float))
            and not isinstance(self.max_interference_cos, bool)
            and 0 < self.max_interference_cos < 1,
            f"gate.max_interference_cos must be in (0, 1) or null (off), got {self.max_interference_cos!r}",
        )
        _check(
            0 < self.max_demographic_parity_gap <= 1 and 0 < self.max_equalized_odds_gap <= 1,
            "gate.max_demographic_parity_gap and max_equalized_odds_gap must be in (0, 1]",
        )
        _check(
            0 < self.calibration_min < 1 < self.calibration_max,
            "gate.calibration_min/max must satisfy 0 < min < 1 < max, "
            f"got {self.calibration_min}/{self.calibration_max}",
        )
        _check(self.latency_budget_ms > 0, "gate.latency_budget_ms must be > 0")
        _check(0.0 < self.canary_share < 1.0, f"gate.canary_share must be in (0, 1), got {self.canary_share}")
        _check(
            self.canary_healthy_windows >= 1 and self.revert_windows >= 1,
            "gate.canary_healthy_windows and revert_windows must be >= 1",
        )
        _check(0 <= self.canary_auc_tolerance < 0.5, "gate.canary_auc_tolerance must be in [0, 0.5)")
        _check(0 < self.revert_drop < 1, f"gate.revert_drop must be in (0, 1), got {self.revert_drop}")
        _check(0 < self.judge_alpha < 1, f"gate.judge_alpha must be in (0, 1), got {self.judge_alpha}")
        _check(self.judge_margin >= 0, f"gate.judge_margin must be >= 0, got {self.judge_margin}")
        _check(
            self.judge_min_effect is None
            or isinstance(self.judge_min_effect, (int, float))
            and not isinstance(self.judge_min_effect, bool)
            and self.judge_min_effect >= -self.judge_margin,
            f"gate.judge_min_effect must be null or >= -judge_margin, got {self.judge_min_effect!r}",
        )
        _check(
            self.judge_release in ("judged", "successor"),
            f"gate.judge_release must be judged or successor, got {self.judge_release!r}",
        )
        _check(
            self.judge_burden in ("candidate", "champion"),
            f"gate.judge_burden must be candidate or champion, got {self.judge_burden!r}",
        )
        _check(
            self.judge_burden == "candidate" or self.judge_min_effect is None,
            "gate.judge_min_effect (superiority) needs judge_burden: candidate (an effect is shown, not presumed)",
        )
        _check(
            self.judge_planned_rows >= 1 and self.judge_min_rows >= 2 and self.judge_max_wait_days >= 1,
            "gate.judge_planned_rows >= 1, judge_min_rows >= 2 and judge_max_wait_days >= 1 are required",
        )
        _check(
            self.live_metrics_url == "" or self.live_metrics_url.startswith(("http://", "https://")),
            f"gate.live_metrics_url must be empty or an http(s) URL, got {self.live_metrics_url!r}",
        )

    def slot_tolerance(self, slot: str) -> float:
        return float(self.slot_tolerances.get(slot, self.slot_auc_tolerance))

    def is_optional(self, check: str) -> bool:
        """Whether the check `check` (e.g. `slot_auc[night]`) may pass unmeasured: it or its family is listed."""
        return check in self.optional_checks or check.split("[", 1)[0] in self.optional_checks


# ---------------------------------------------------------------- loading


def load_gate_policy(path: str | os.PathLike | None = None, overrides: dict | None = None) -> GatePolicy:
    path = path or os.environ.get("CTR_GATE_POLICY") or DEFAULT_GATE_YAML
    return from_dict(GatePolicy, deep_merge(read_yaml(path), overrides or {}), where=str(path))
