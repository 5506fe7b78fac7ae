"""Training readers take only what validation passed, as it is now (pipelines.data.validated).

The base model's window (`splits.load_split`, so `training.base_model.train`) and the cold-start
window with its history (`cold.prepare`) refuse a day never validated, a quarantined day, and a day
re-written after it was validated, naming each, before any data is read. The markers come from the
real validation stage; the streaming reader of adapter training and evaluation is covered in
tests/pipelines/model/test_stream.py.
"""

from __future__ import annotations

import pytest

from pipelines.config import BaseTrainConfig, ColdStartConfig, DataConfig, PipelineConfig
from pipelines.data import cold
from pipelines.data.lake import Lake
from pipelines.data.splits import load_split
from pipelines.data.synthetic import SLOTS, write_days
from pipelines.data.validated import MARKER, UnvalidatedPartitionError, read_marker, read_validated_window
from pipelines.errors import DataValidationError, LakeError
from pipelines.training import base_model
from pipelines.validation.stage import validate_window
from tests.conftest import validate_lake
from tests.pipelines.training.helpers import CFG, SPEC

DAYS = ("2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05")


@pytest.fixture
def lake(tmp_path) -> Lake:
    """Three validated days; the fourth arrives later."""
    lk = Lake(str(tmp_path / "lake"))
    write_days(lk, SPEC, DAYS[0], 3, 2000)
    validate_lake(lk.uri)
    return lk


def config(lake: Lake) -> PipelineConfig:
    return PipelineConfig(
        data=DataConfig(lake_uri=lake.uri, slots=SLOTS),
        model=CFG,
        base_training=BaseTrainConfig(train_start=DAYS[0], epochs=1),
        cold_start=ColdStartConfig(window_days=2, history_days=2),
    )


def quarantine(lake: Lake, day: str) -> None:
    """Re-write `day` with its labels flipped (CTR ~97 %) and let the real validation stage judge it."""
    frame = lake.read_partition(day).frame
    frame["label"] = (1 - frame["label"]).astype(frame["label"].dtype)
    lake.write_partition(frame, day, overwrite=True)
    with pytest.raises(DataValidationError):
        validate_window(config(lake), lake.uri, day, 1)


def observed(exc: UnvalidatedPartitionError) -> dict[str, str]:
    return {f["check"].rsplit("dt=", 1)[1]: f["observed"] for f in exc.failures}


def test_a_validated_window_reads(lake):
    parts = read_validated_window(lake, DAYS[2], 3)
    assert [p.dt for p in parts] == list(DAYS[:3])
    split = load_split(lake.uri, DAYS[2], 0.2, start_day=DAYS[0])
    assert split.lineage["partitions"] == {p.dt: p.sha256 for p in parts}


def test_base_model_training_refuses_an_unvalidated_a_quarantined_and_a_re_written_day(lake):
    write_days(lake, SPEC, DAYS[3], 1, 2000)  # arrived, not validated
    quarantine(lake, DAYS[1])
    write_days(lake, SPEC, DAYS[0], 1, 2000, chunk_rows=600, overwrite=True)  # same rows, new bytes: new hash
    with pytest.raises(UnvalidatedPartitionError) as info:
        base_model.train(config(lake), lake.uri, DAYS[3])  # refused before MLflow is touched
    got = observed(info.value)
    assert sorted(got) == [DAYS[0], DAYS[1], DAYS[3]]  # every bad day, not the first one
    assert got[DAYS[0]].startswith("re-written since it was validated (marker sha256 ")
    assert got[DAYS[1]] == "validation status 'quarantined', not 'passed'"
    assert got[DAYS[3]] == "no validation marker (never validated)"
    assert isinstance(info.value, DataValidationError)  # the CLI prints every line, exit 1
    with pytest.raises(UnvalidatedPartitionError, match=f"dt={DAYS[3]}"):
        load_split(lake.uri, DAYS[3], 0.2, days=1)


def test_cold_start_refuses_a_quarantined_day_in_its_history(lake):
    write_days(lake, SPEC, DAYS[3], 1, 2000)
    validate_lake(lake.uri)
    quarantine(lake, DAYS[0])  # history, not window
    cfg = config(lake)
    assert cold.read_days(cfg) == 4
    with pytest.raises(UnvalidatedPartitionError) as info:
        cold.prepare(cfg, lake.uri, DAYS[3], cold.ALL, {"cutoff": DAYS[0]})
    assert list(observed(info.value)) == [DAYS[0]]


def test_a_corrupt_marker_is_refused_not_trusted(lake):
    lake.put_bytes(f"dt={DAYS[2]}/_{MARKER}.json", b'{"status": "passed", ')
    with pytest.raises(UnvalidatedPartitionError) as info:
        read_validated_window(lake, DAYS[2], 1)
    assert observed(info.value)[DAYS[2]].startswith("validation marker unreadable:")
    with pytest.raises(LakeError, match="not JSON"):
        read_marker(lake, DAYS[2])
