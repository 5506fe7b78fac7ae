"""Streaming batches from the lake: every row once, bounded buffer, splits by lake order, determinism, resume."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.config import DataConfig, LoraTrainConfig, PipelineConfig
from pipelines.data.lake import Lake, concat
from pipelines.data.synthetic import SLOTS, write_days
from pipelines.data.validated import UnvalidatedPartitionError
from pipelines.errors import DataValidationError
from pipelines.model import adapters, features
from pipelines.model.stream import LakeIndex, LakeStream, holdout_streams, stream_split
from pipelines.training.checkpoint import CheckpointStore
from pipelines.training.loop import LoopSettings, fit, seed_everything
from pipelines.validation.stage import validate_window
from tests.conftest import validate_lake
from tests.pipelines.training.helpers import CFG, SPEC, base

DAYS = ("2024-01-02", "2024-01-03", "2024-01-04")


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("lake"))
    write_days(Lake(uri), SPEC, DAYS[0], len(DAYS), 3000, chunk_rows=1000)  # 3 files per day
    validate_lake(uri)  # streams feed training and evaluation: validated days only
    return uri


def lake_rows(uri: str, slot: str | None) -> pd.DataFrame:
    """The window read the in-memory way, in lake order (day, file, row)."""
    frame = concat(Lake(uri).read_window(DAYS[-1], len(DAYS)))
    return frame[frame["slot"] == slot].reset_index(drop=True) if slot else frame


def collect(stream: LakeStream, batch_size: int, seed: int | None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    batches = list(stream.batches(batch_size, gen))
    return batches, np.concatenate([b[0].numpy() for b in batches]), np.concatenate([b[1].numpy() for b in batches])


def sort_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    both = np.concatenate([x, y[:, None].astype(np.int64)], axis=1)
    return both[np.lexsort(both.T[::-1])]


@pytest.mark.parametrize("slot", ["feed", None])
def test_stream_yields_every_row_of_the_lake_once_through_a_bounded_buffer(lake, slot):
    frame = lake_rows(lake, slot)
    index = LakeIndex(lake, DAYS[-1], days=len(DAYS), slot=slot)
    assert len(index.files) == 9 and index.rows == len(frame)
    stream = LakeStream(index, 0, index.rows, CFG, read_rows=256, buffer_rows=700)
    batches, x, y = collect(stream, 64, seed=1)
    assert len(x) == len(frame) and len(batches) == -(-len(frame) // 64)
    assert all(len(b[1]) == 64 for b in batches[:-1])
    expected_x, expected_y = features.encode(frame, CFG), features.labels(frame)
    np.testing.assert_array_equal(sort_rows(x, y), sort_rows(expected_x, expected_y))  # same multiset of rows
    assert not np.array_equal(x, expected_x)  # ... shuffled
    assert 700 <= stream.peak_buffer <= 700 + 256  # bounded buffer
    # unshuffled: exactly the lake order
    _, xo, yo = collect(stream, 64, seed=None)
    np.testing.assert_array_equal(xo, expected_x)
    np.testing.assert_array_equal(yo, expected_y)


def test_stream_order_is_a_function_of_the_generator(lake):
    index = LakeIndex(lake, DAYS[-1], days=len(DAYS), slot="feed")
    stream = LakeStream(index, 0, index.rows, CFG, read_rows=256, buffer_rows=700)
    _, a, _ = collect(stream, 64, seed=1)
    _, b, _ = collect(stream, 64, seed=1)
    _, c, _ = collect(stream, 64, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stream_split_ranges_follow_lake_order(lake):
    frame = lake_rows(lake, "feed")
    parts = stream_split(
        lake, DAYS[-1], CFG, days=len(DAYS), slot="feed", holdout_fraction=0.2, val_fraction=0.1, read_rows=300
    )
    n = len(frame)
    cut_h = int(round(n * 0.8))
    cut_v = int(round(cut_h * 0.9))
    assert (parts.train.rows, parts.val.rows, parts.holdout.rows) == (cut_v, cut_h - cut_v, n - cut_h)
    for name, (lo, hi) in {"train": (0, cut_v), "val": (cut_v, cut_h), "holdout": (cut_h, n)}.items():
        _, x, y = collect(getattr(parts, name), 50, seed=None)
        np.testing.assert_array_equal(x, features.encode(frame.iloc[lo:hi], CFG))
    assert frame["event_ts"].iloc[cut_h:].min() >= frame["event_ts"].iloc[:cut_h].max()  # holdout is the newest


def test_stream_reads_from_s3(lake, s3_bucket):
    src = Lake(lake)
    dst = Lake(f"s3://{s3_bucket}/clicks")
    for day in DAYS[:1]:
        for f in src.objects(day):  # parts, manifest and validation marker: the committed, validated day
            dst.put_bytes(f[len(src.uri) + 1 :], open(f, "rb").read())
    local = LakeIndex(lake, DAYS[0], slot="search")
    remote = LakeIndex(dst.uri, DAYS[0], slot="search")
    assert remote.rows == local.rows > 0
    _, xr, _ = collect(LakeStream(remote, 0, remote.rows, CFG), 64, seed=None)
    _, xl, _ = collect(LakeStream(local, 0, local.rows, CFG), 64, seed=None)
    np.testing.assert_array_equal(xr, xl)


def test_training_on_a_stream_is_deterministic_and_resumes_exactly(lake, tmp_path):
    parts = stream_split(
        lake, DAYS[-1], CFG, days=len(DAYS), slot="feed", val_fraction=0.1, read_rows=256, buffer_rows=512
    )
    lcfg = LoraTrainConfig(r=4, alpha=8)
    settings = LoopSettings(3, 64, 5e-3, 0.0, 2, 7, patience=3)
    init = base()

    def run(**kw):
        seed_everything(7)
        model = adapters.attach(copy.deepcopy(init), lcfg)
        res = fit(model, parts.train, settings, val=parts.val, **kw)
        return res, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    ref, wa = run()
    again, wb = run()
    assert ref["epochs_run"] == 3 and "val_auc" in ref["history"][0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    store = CheckpointStore(str(tmp_path / "ck"))

    def crash(m):
        if m["epoch"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(checkpoint=store, on_epoch=crash)
    resumed, wc = run(checkpoint=store)
    assert resumed["resumed_from_epoch"] == 1
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def test_training_streams_refuse_days_not_validated_as_they_are_now(tmp_path):
    """Unvalidated, quarantined, and re-written-after-validation days are all refused, named, before any
    row is read; validating the current content lifts the refusal."""
    uri = str(tmp_path / "lake")
    lake = Lake(uri)
    write_days(lake, SPEC, DAYS[0], 2, 2000)
    validate_lake(uri)
    cfg = PipelineConfig(
        data=DataConfig(lake_uri=uri, slots=SLOTS), model=CFG, lora=LoraTrainConfig(window_days=3, min_rows=10)
    )
    write_days(lake, SPEC, DAYS[2], 1, 2000)  # never validated
    flipped = lake.read_partition(DAYS[1]).frame
    flipped["label"] = (1 - flipped["label"]).astype(flipped["label"].dtype)
    lake.write_partition(flipped, DAYS[1], overwrite=True)
    with pytest.raises(DataValidationError):
        validate_window(cfg, uri, DAYS[1], 1)  # quarantined
    write_days(lake, SPEC, DAYS[0], 1, 2000, chunk_rows=700, overwrite=True)  # same rows, new parts: new hash

    with pytest.raises(UnvalidatedPartitionError) as info:
        holdout_streams(cfg, uri, DAYS[2], "feed", CFG)
    observed = {f["check"]: f["observed"] for f in info.value.failures}
    assert list(observed) == [f"validated_partition @ dt={d}" for d in DAYS]
    assert observed[f"validated_partition @ dt={DAYS[0]}"].startswith("re-written since it was validated")
    assert observed[f"validated_partition @ dt={DAYS[1]}"] == "validation status 'quarantined', not 'passed'"
    assert observed[f"validated_partition @ dt={DAYS[2]}"] == "no validation marker (never validated)"
    assert "Validate these days first" in str(info.value)
    with pytest.raises(UnvalidatedPartitionError, match=f"dt={DAYS[2]}"):
        LakeIndex(uri, DAYS[2], days=1, slot="feed")

    write_days(lake, SPEC, DAYS[1], 1, 2000, overwrite=True)  # the upstream fix, re-exported
    validate_lake(uri)
    streams = holdout_streams(cfg, uri, DAYS[2], "feed", CFG)
    assert streams.index.lineage()["partitions"] == {d: lake.read_partition(d).sha256 for d in DAYS}
