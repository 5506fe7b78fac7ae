"""scripts/replay_days.py without Airflow: the days and the order of the DAG runs of each day, and a bad range.
The replay itself runs in tests/e2e/test_replay_days.py."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("replay_days", REPO / "scripts" / "replay_days.py")
replay_days = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_days)


def test_each_day_is_validated_then_monitored_then_retrained():
    assert replay_days.days("1998-02-27", "1998-03-01") == ["1998-02-27", "1998-02-28", "1998-03-01"]
    assert replay_days.steps("1998-03-01", 60) == [
        ("ctr_lake_arrival", {"day": "1998-03-01", "wait_timeout_s": 60}),
        ("ctr_champion_monitor", {"day": "1998-03-01"}),
        ("ctr_lora_retrain", {"end_day": "1998-03-01"}),
    ]


def test_a_range_that_ends_before_it_starts_is_refused():
    proc = subprocess.run(
        [sys.executable, "scripts/replay_days.py", "--from", "1998-03-02", "--to", "1998-03-01"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "is before --from" in proc.stderr
