"""`python -m pipelines backtest --faults`: what stops a broken day before it serves (issue 31).

One `served` replay (the pipeline itself: validation, monitor, retrain, gate, release; `backtest_served`)
over the `--quick` days and the day after them, with every slot's rows. Its first day lands clean (the first
champions), and each later day lands with one fault of `bench.faults`, in their order. Each fault keeps the
contract (columns, types, domains, event times inside the day), so what stops it is judgement: validation's consistency
checks, or the gate. `faults_caught` names the stage that stopped each fault before it served, or None
(a fault withdrawn by the monitor reached the canary's users first, so it counts as not stopped).

After its evening, each faulty day is repaired: its true rows land over it and validate, as an operator
fixes a quarantined partition. So each fault meets the lake it would meet alone; what a fault got released
stays released, and the faults after it are judged against that champion.
"""

from __future__ import annotations

import logging
import time

from pipelines.bench.backtest import QUICK_DAYS, replay
from pipelines.bench.backtest_protocol import build
from pipelines.bench.backtest_served import Served
from pipelines.bench.faults import FAULTS
from pipelines.config import PipelineConfig, load_gate_policy
from pipelines.data import movielens

log = logging.getLogger(__name__)

# The contract's own checks (columns, types, nulls, domains; event time): a fault that fails one tests the
# schema, not judgement. The label-rate bands are judgement (a flipped ad log fails its absolute band).
CONTRACT_CHECKS = (
    "expect_column_to_exist",
    "expect_column_values_to_",
    "expect_column_value_lengths_",
    "expect_table_columns_",
    "event_ts_in_partition_day",
    "no_future_event_ts",
)
BEFORE_SERVING = ("validation", "gate")


def plan(dates: list[str]) -> dict[str, str]:
    """{day: fault}: the first day clean, then one fault a day in `FAULTS`' order."""
    if len(dates) < len(FAULTS) + 1:
        raise ValueError(f"the fault suite needs {len(FAULTS) + 1} days, got {len(dates)}")
    return dict(zip(dates[1:], FAULTS))


def run(cfg: PipelineConfig, frame=None, *, served_dir: str | None = None, policy=None) -> dict:
    """The replay with its faults; returns `faults_caught` ({fault: stage or None}) and each fault's outcome."""
    if frame is None:
        frame = movielens.load()
    # One day more than --quick: a candidate judged on the next days (lora.judged_on: next_day) trained on
    # the last faulty day is judged on the day after it.
    bt = build(frame, None, None, QUICK_DAYS + 1)
    faults = plan([d.date for d in bt.days])
    served = Served(cfg, policy or load_gate_policy(), served_dir, faults=faults, repair_faults=True)
    t0 = time.perf_counter()
    replay({"served": served}, bt)
    outcomes = served.info()["faults"]
    caught = {o["fault"]: o["caught_by"] if o["caught_by"] in BEFORE_SERVING else None for o in outcomes.values()}
    return {
        "from": bt.days[0].date,
        "to": bt.days[-1].date,
        "faults_caught": caught,
        "all_caught": all(caught.values()),
        "faults": [_entry(o) for o in outcomes.values()],
        "served_dir": str(served.workdir),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _entry(outcome: dict) -> dict:
    """The outcome, and whether the fault kept the contract (no schema or event-time check failed)."""
    broken = [c for c in outcome.get("failed_checks", []) if c.startswith(CONTRACT_CHECKS)]
    return {**outcome, "kept_the_contract": not broken, "contract_checks_failed": broken}


def table(r: dict) -> str:
    lines = [
        f"fault suite {r['from']}..{r['to']} ({r['wall_s']} s): "
        f"{sum(bool(v) for v in r['faults_caught'].values())} of {len(r['faults_caught'])} stopped before serving",
        "",
        "| fault | day | stopped by | why |",
        "|---|---|---|---|",
    ]
    for e in r["faults"]:
        why = ", ".join(e.get("failed_checks") or []) or e.get("why", "")
        lines.append(f"| {e['fault']} | {e['day']} | {r['faults_caught'][e['fault']] or 'NOT STOPPED'} | {why[:120]} |")
    return "\n".join(lines)
