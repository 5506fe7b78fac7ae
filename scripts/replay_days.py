"""Replay a range of days through the Airflow DAGs, day-exact (docs/runbook.md, "Replay a range of days").

For each day, in order: `ctr_lake_arrival` (wait for the partition, validate it), `ctr_champion_monitor`
(the morning's champions and canaries scored on it: promotions, withdrawals, reverts), `ctr_lora_retrain`
(every slot trained on the window ending that day, gated, released). Each is an in-process DAG run
(`airflow dags test`), so a day's retrain has finished before the next day is validated: the order the
backtest's `served` comparator uses. An Airflow backfill of `ctr_lake_arrival` would merge the asset
events of days that land while a retrain still runs.

    python scripts/replay_days.py --from 1998-03-07 --to 1998-04-22 [--wait-timeout-s 60]

The environment is the caller's (`source scripts/env.sh` for the demo's stack). The first failed DAG run
stops the replay; its exit code is the script's, and the day and DAG are printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path


def days(first: str, last: str) -> list[str]:
    a, b = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
    if b < a:
        raise SystemExit(f"--to {last} is before --from {first}")
    return [(a + dt.timedelta(days=i)).isoformat() for i in range((b - a).days + 1)]


def steps(day: str, wait_timeout_s: int) -> list[tuple[str, dict]]:
    return [
        ("ctr_lake_arrival", {"day": day, "wait_timeout_s": wait_timeout_s}),
        ("ctr_champion_monitor", {"day": day}),
        ("ctr_lora_retrain", {"end_day": day}),
    ]


def airflow_cli() -> str:
    """The `airflow` of this interpreter's environment, else the one on PATH."""
    here = Path(sys.executable).with_name("airflow")
    found = str(here) if here.exists() else shutil.which("airflow")
    if not found:
        raise SystemExit("no airflow executable next to this python or on PATH")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="first", required=True, help="first day, YYYY-MM-DD")
    p.add_argument("--to", dest="last", required=True, help="last day, YYYY-MM-DD")
    p.add_argument("--wait-timeout-s", type=int, default=60, help="ctr_lake_arrival: how long to wait for a day")
    a = p.parse_args(argv)
    replayed = days(a.first, a.last)
    airflow = airflow_cli()
    for day in replayed:
        for dag_id, conf in steps(day, a.wait_timeout_s):
            print(f"replay {day}: {dag_id}", flush=True)
            rc = subprocess.run([airflow, "dags", "test", dag_id, day, "-c", json.dumps(conf)]).returncode
            if rc != 0:
                print(f"replay stopped: {dag_id} for {day} failed (exit {rc})", file=sys.stderr, flush=True)
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
