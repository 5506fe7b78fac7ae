"""Evidence that stays valid when it is looked at every day: the decision core of the prequential gate
(issue 31, item 3: a candidate judged on the days after it was trained, beside the champion, on the same rows).

Evidence is per judged row: the paired logloss difference `d = logloss(champion) - logloss(candidate)` on the
same row (positive: the candidate predicts the row better). Logloss is a proper score and adds up over rows,
so the days a candidate waits simply add rows; AUC does not add up. `Evidence` keeps the count, the sum and the
sum of squares: mergeable in any order, small enough for a registry tag.

The interval is the asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas
("Time-uniform central limit theory and asymptotic confidence sequences", Annals of Statistics, 2024): with
the running mean and standard deviation of the differences,

    mean_t +/- sd_t * sqrt(2 (t rho^2 + 1) / (t^2 rho^2) * log(sqrt(t rho^2 + 1) / alpha)),

rho chosen to be tightest at `planned_rows` (rho^2 = (-2 log alpha + log(-2 log alpha + 1)) / planned_rows).
It covers the true mean at every t at once (asymptotically, with probability >= 1 - alpha): a gate may look at
a waiting candidate every day, and stop at any of them, without the repeated-looks inflation that a daily
fixed-sample test has (tests/pipelines/promotion/test_sequential.py measures both).

`decide` is pure. Reject when the upper bound is below `-margin` (worse beyond the margin, at any look). With
the burden on the candidate, release when the lower bound clears `-margin` (shown non-inferior: a fresher model
no worse than the margin serves) and, with `min_effect` set, also `min_effect` (superiority); otherwise wait for
more rows. With the burden on the champion, release whatever is not rejected once `min_rows` rows are in: a
fresher model is presumed at least as good, and only evidence of harm holds it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipelines.metrics import paired_differences, row_logloss  # noqa: F401  (the evidence's unit, re-exported)


@dataclass(frozen=True)
class Evidence:
    """Paired per-row differences accumulated so far: their count, sum and sum of squares."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, diffs) -> "Evidence":
        d = np.asarray(diffs, dtype=np.float64)
        if d.ndim != 1 or not np.isfinite(d).all():
            raise ValueError("evidence: the differences must be a 1-d array of finite numbers")
        return Evidence(self.n + len(d), self.total + float(d.sum()), self.total_sq + float((d * d).sum()))

    def merge(self, other: "Evidence") -> "Evidence":
        return Evidence(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def sd(self) -> float | None:
        """The sample standard deviation (None below two rows)."""
        if self.n < 2:
            return None
        var = (self.total_sq - self.total * self.total / self.n) / (self.n - 1)
        return math.sqrt(max(var, 0.0))

    def to_json(self) -> dict:
        return {"n": self.n, "total": self.total, "total_sq": self.total_sq}

    @classmethod
    def from_json(cls, d: dict) -> "Evidence":
        return cls(int(d["n"]), float(d["total"]), float(d["total_sq"]))


def radius(n: int, sd: float, alpha: float, planned_rows: int) -> float:
    """The confidence sequence's half-width after `n` rows of standard deviation `sd`."""
    if n < 1 or not 0 < alpha < 1 or planned_rows < 1:
        raise ValueError(f"radius: needs n >= 1, 0 < alpha < 1, planned_rows >= 1 (got {n}, {alpha}, {planned_rows})")
    rho2 = (-2 * math.log(alpha) + math.log(-2 * math.log(alpha) + 1)) / planned_rows
    return sd * math.sqrt(2 * (n * rho2 + 1) / (n * n * rho2) * math.log(math.sqrt(n * rho2 + 1) / alpha))


def interval(ev: Evidence, alpha: float, planned_rows: int) -> tuple[float, float] | None:
    """(lower, upper) bound on the mean difference, valid at every look; None below two rows."""
    if ev.sd is None:
        return None
    r = radius(ev.n, ev.sd, alpha, planned_rows)
    return ev.mean - r, ev.mean + r


def decide(
    ev: Evidence,
    *,
    alpha: float,
    margin: float,
    planned_rows: int,
    min_rows: int = 100,
    min_effect: float | None = None,
    burden: str = "candidate",
) -> dict:
    """{"verdict": "release" | "reject" | "wait", "lower", "upper", "mean", "n", "reason", "bar", "tested"}:
    `tested` names the bound the verdict read ("lower" or "upper") and `bar` what it was held against."""
    if margin < 0 or (min_effect is not None and min_effect < -margin):
        raise ValueError(f"decide: margin must be >= 0 and min_effect >= -margin (got {margin}, {min_effect})")
    if burden not in ("candidate", "champion") or (burden == "champion" and min_effect is not None):
        raise ValueError(f"decide: burden must be candidate or champion, champion without min_effect (got {burden})")
    bounds = interval(ev, alpha, planned_rows) if ev.n >= min_rows else None
    out = {
        "n": ev.n,
        "mean": ev.mean,
        "lower": None,
        "upper": None,
        "alpha": alpha,
        "margin": margin,
        "min_effect": min_effect,
        "burden": burden,
    }
    if bounds is None:
        return {**out, "verdict": "wait", "reason": f"{ev.n} judged rows, fewer than {min_rows}"}
    lo, hi = bounds
    out.update(lower=lo, upper=hi)
    bar = -margin if min_effect is None else max(-margin, min_effect)
    out.update(bar=bar, tested="lower" if burden == "candidate" else "upper")
    if hi < -margin:
        return {
            **out,
            "verdict": "reject",
            "reason": f"worse than the champion beyond the margin: upper bound {hi:.5f} < -{margin}",
        }
    if burden == "champion":
        return {**out, "verdict": "release", "reason": f"not shown worse: upper bound {hi:.5f} >= -{margin}"}
    if lo > bar:
        return {
            **out,
            "verdict": "release",
            "reason": f"lower bound {lo:.5f} > {bar:g}"
            + (" (non-inferior)" if min_effect is None else " (the minimum effect)"),
        }
    return {**out, "verdict": "wait", "reason": f"undecided: [{lo:.5f}, {hi:.5f}] straddles {bar:g}"}
