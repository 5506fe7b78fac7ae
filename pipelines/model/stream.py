"""Training batches streamed from the lake, in memory bounded by the read chunk and the shuffle buffer
instead of the row count.

`LakeIndex` lists the window's committed parts (each day's manifest, `data.commit`), refuses a day
whose validation marker does not say `passed` for that content (`data.validated`), counts each
part's rows of the slot (reading only the `slot` column) and hashes their bytes (the same partition
hashes as `data.lake.lineage`, so a streamed run records the same data lineage as an in-memory read).
Rows have a canonical order: partition date, part (manifest order), row in part. A
`LakeStream` is a range of that order (train / val / holdout are consecutive ranges, the newest
last, as in `data.splits.time_split` but by lake order rather than a global sort). Each epoch it
reads the files of its range in a shuffled order, record batch by record batch
(`ParquetFile.iter_batches`), keeps the slot's rows, encodes them with the model family's encoding
(`model.family.encode`),
and shuffles them through a bounded buffer with the loop's seeded generator, so an epoch is a pure
function of that generator's state (what checkpoints save) and resume stays exact.

Memory: one read chunk (`read_rows`) + the buffer (`buffer_rows` + `read_rows` encoded rows, 8 bytes per
input column: 80 bytes a row for the tabular families, 8 * max_len for text) + for S3 one parquet object's
bytes (a local file is read in place); with a token cache, one part's tokens (4 bytes per id).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipelines.config import ModelConfig, PipelineConfig
from pipelines.data.commit import check_content
from pipelines.data.lake import Lake, split_s3
from pipelines.data.schema import FEATURE_FIELDS, OPTIONAL
from pipelines.data.validated import validated_manifests
from pipelines.errors import LakeError, PipelineError
from pipelines.model import family, features

# What a frame of the stream holds by default: the model's features, the label and the optional contract
# columns a part has (a family that reads text finds its columns there; `frames` leaves absent ones out).
_COLUMNS = list(FEATURE_FIELDS) + ["label"] + list(OPTIONAL)
log = logging.getLogger(__name__)
TOKEN_CACHE = "_tokens"  # <lake>/_tokens/<encoding key>/<part sha256>.npy: a part's tokens (family.encoding_key)


@dataclass(frozen=True)
class LakeFile:
    day: str
    key: str  # local path, or object key in the lake's bucket
    rows: int  # rows of the slot (all rows without a slot filter)
    sha256: str = ""  # the part's committed content hash (its manifest entry)


class LakeIndex:
    """The files of a window, in canonical order, with their row counts for `slot`."""

    def __init__(
        self,
        lake_uri: str,
        end_day: str,
        days: int | None = None,
        start_day: str | None = None,
        slot: str | None = None,
    ):
        self.lake, self.slot = Lake(lake_uri), slot
        # Refused before a byte of data is read: training and evaluation only see validated content.
        manifests = validated_manifests(self.lake, end_day, days or 1, start_day)
        self.files, self.partition_sha256 = [], {}
        for d, man in manifests.items():
            digest = hashlib.sha256()  # as Lake.read_partition hashes a partition: its parts' bytes in order
            for p in man.parts:
                k = self.lake.key_of(f"dt={d}/{p.name}")
                self.files.append(LakeFile(d, k, self._count(k, digest, p.sha256), p.sha256))
            self.partition_sha256[d] = digest.hexdigest()
            # The bytes indexed must be those validated: a part replaced after its commit is refused.
            check_content(man, self.partition_sha256[d], self.lake.partition_uri(d))
        self.rows = sum(f.rows for f in self.files)

    def lineage(self) -> dict:
        """The window's lineage, equal to `data.lake.lineage` of the same partitions read in memory."""
        per = self.partition_sha256
        return {
            "partitions": dict(per),
            "sha256": hashlib.sha256(json.dumps(per, sort_keys=True).encode()).hexdigest(),
            "first": min(per) if per else None,
            "last": max(per) if per else None,
            "count": len(per),
        }

    def _bytes(self, key: str) -> bytes:
        _, prefix = split_s3(self.lake.uri)
        return self.lake.get_bytes(key[len(prefix) + 1 :] if prefix else key)

    def open(self, key: str) -> pq.ParquetFile:
        if not self.lake.is_s3:
            return pq.ParquetFile(key)
        return pq.ParquetFile(io.BytesIO(self._bytes(key)))

    def _count(self, key: str, digest, committed_sha256: str) -> int:
        """Rows of the slot in one part; feeds the part's bytes to the partition's digest on the way, and
        refuses a part whose bytes are not the committed ones (replaced after its commit)."""
        own = hashlib.sha256()
        try:
            if self.lake.is_s3:
                payload = self._bytes(key)
                digest.update(payload)
                own.update(payload)
                pf = pq.ParquetFile(io.BytesIO(payload))
            else:
                with open(key, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 22), b""):
                        digest.update(block)
                        own.update(block)
                pf = None
            if own.hexdigest() != committed_sha256:
                raise LakeError(
                    f"object {key} of the lake {self.lake.uri} changed after it was committed: its "
                    "bytes are not the ones its manifest lists; re-write the partition"
                )
            pf = pf or pq.ParquetFile(key)
            if self.slot is None:
                return pf.metadata.num_rows
            return int(pc.sum(pc.equal(pf.read(columns=["slot"]).column("slot"), self.slot)).as_py() or 0)
        except (pa.ArrowInvalid, OSError) as exc:
            raise LakeError(f"object {key} of the lake {self.lake.uri} is not readable parquet: {exc}") from exc

    def _ranges(self, lo: int, hi: int, order: list[int] | None) -> Iterator[tuple[int, int, int]]:
        """(file, first, end) of the slot's rows of each file that [lo, hi) of the canonical order touches."""
        offsets = np.concatenate([[0], np.cumsum([f.rows for f in self.files])]).astype(np.int64)
        for i in order if order is not None else range(len(self.files)):
            a, b = max(lo, int(offsets[i])), min(hi, int(offsets[i + 1]))
            if a < b:  # outside the range: not even opened
                yield i, a - int(offsets[i]), b - int(offsets[i])

    def _present(self, pf: pq.ParquetFile, key: str, cols: list[str]) -> list[str]:
        """`cols` the part has; an absent optional column is left out, an absent required one refused."""
        names = set(pf.schema_arrow.names)
        missing = [c for c in cols if c not in names and c not in OPTIONAL]
        if missing:
            raise LakeError(f"object {key} of the lake {self.lake.uri} lacks the columns {missing}")
        return [c for c in cols if c in names]

    def frames(
        self, lo: int, hi: int, read_rows: int, order: list[int] | None = None, columns: list[str] | None = None
    ) -> Iterator[pd.DataFrame]:
        """Contract rows [lo, hi) of the canonical order as frames of at most `read_rows`, file by file in `order`."""
        for i, a, b in self._ranges(lo, hi, order):
            pf = self.open(self.files[i].key)
            cols = self._present(pf, self.files[i].key, list(columns or _COLUMNS))
            read_cols = cols + (["slot"] if "slot" not in cols else [])
            pos = 0
            for rb in pf.iter_batches(batch_size=read_rows, columns=read_cols):
                if self.slot is not None:
                    rb = rb.filter(pc.equal(rb.column("slot"), self.slot))
                n = rb.num_rows
                s, e = max(a - pos, 0), min(b - pos, n)
                pos += n
                if s < e:
                    yield rb.slice(s, e - s).select(cols).to_pandas(types_mapper={pa.string(): pd.StringDtype()}.get)
                if pos >= b:
                    break

    def chunks(
        self, lo: int, hi: int, read_rows: int, cfg: ModelConfig, order: list[int] | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(tokens, labels) of the rows [lo, hi) of the canonical order, file by file in `order`. A family with
        an encoding key (text: tokenising is the slow part) reads each part's tokens from the lake's token
        cache, written on first use; the others encode as they read."""
        key = family.encoding_key(cfg)
        if key is None:
            for frame in self.frames(lo, hi, read_rows, order):
                yield family.encode(frame, cfg), features.labels(frame)
            return
        for i, a, b in self._ranges(lo, hi, order):
            f = self.files[i]
            pf = self.open(f.key)
            tokens = self._part_tokens(f, pf, key, cfg)
            table = pf.read(columns=["slot", "label"])
            keep = (
                np.ones(table.num_rows, bool)
                if self.slot is None
                else pc.equal(table.column("slot"), self.slot).to_numpy(zero_copy_only=False)
            )
            x, y = tokens[keep][a:b], table.column("label").to_numpy().astype(np.float32)[keep][a:b]
            for j in range(0, len(y), read_rows):
                yield x[j : j + read_rows].astype(np.int64), y[j : j + read_rows]

    def _part_tokens(self, f: LakeFile, pf: pq.ParquetFile, key: str, cfg: ModelConfig) -> np.ndarray:
        """Tokens of every row of part `f` (int32), from the cache, or encoded and cached. The cache is keyed
        by the part's committed content hash and the encoding's key, so it is never stale."""
        rel = f"{TOKEN_CACHE}/{key}/{f.sha256}.npy"
        required, optional = family.columns(cfg)
        frame = pf.read(columns=self._present(pf, f.key, list(required) + list(optional))).to_pandas(
            types_mapper={pa.string(): pd.StringDtype()}.get
        )
        tokens = self._cached(rel, frame, cfg)
        if tokens is not None:
            return tokens
        tokens = family.encode(frame, cfg).astype(np.int32)
        buf = io.BytesIO()
        np.save(buf, tokens, allow_pickle=False)
        try:
            self.lake.put_bytes(rel, buf.getvalue())
        except LakeError as exc:  # a cache only saves time: a read-only lake still trains
            log.warning("could not write the token cache %s/%s: %s", self.lake.uri, rel, exc)
        return tokens

    def _cached(self, rel: str, frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray | None:
        """The cached tokens of `frame`'s part, or None (a miss) when there are none, they cannot be read,
        or they are not what encoding the part gives: shape, type, and its first and last rows re-encoded."""
        try:
            payload = self.lake.get_bytes_if_exists(rel)
            tokens = None if payload is None else np.load(io.BytesIO(payload), allow_pickle=False)
        except (LakeError, ValueError, OSError) as exc:
            log.warning("token cache %s/%s unreadable, encoding again: %s", self.lake.uri, rel, exc)
            return None
        if tokens is None:
            return None
        ends = frame.iloc[[0, -1]] if len(frame) else frame
        if (
            tokens.dtype != np.int32
            or tokens.ndim != 2
            or len(tokens) != len(frame)
            or (len(frame) and not np.array_equal(tokens[[0, -1]], family.encode(ends, cfg)))
        ):
            log.warning("token cache %s/%s does not match its part, encoding again", self.lake.uri, rel)
            return None
        return tokens


class LakeStream:
    """A batch source (see training.loop) over the rows [lo, hi) of a LakeIndex."""

    def __init__(
        self, index: LakeIndex, lo: int, hi: int, cfg: ModelConfig, read_rows: int = 65_536, buffer_rows: int = 262_144
    ):
        if not (0 <= lo <= hi <= index.rows):
            raise ValueError(f"row range [{lo}, {hi}) is outside the index's {index.rows} rows")
        if read_rows < 1 or buffer_rows < 1:
            raise ValueError("read_rows and buffer_rows must be >= 1")
        self.index, self.lo, self.hi, self.cfg = index, lo, hi, cfg
        self.read_rows, self.buffer_rows = read_rows, buffer_rows
        self.rows = hi - lo
        self.peak_buffer = 0  # largest number of rows held in the shuffle buffer (tests, diagnostics)

    def frames(self, read_rows: int | None = None, columns: list[str] | None = None) -> Iterator[pd.DataFrame]:
        """The range's contract rows, in order, as frames of at most `read_rows` rows (for scoring)."""
        return self.index.frames(self.lo, self.hi, read_rows or self.read_rows, columns=columns)

    def head(self, n: int) -> pd.DataFrame:
        """The range's first `n` rows (an input example), read with the normal chunk size: a tiny chunk
        size would walk the file to the range's start a few rows at a time."""
        frames = self.frames()
        try:
            return next(frames, pd.DataFrame()).head(n).reset_index(drop=True)
        finally:
            frames.close()

    def batches(
        self, batch_size: int, gen: torch.Generator | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once; batches of `batch_size` except the last. Shuffled with `gen`, in order without."""
        order = None
        if gen is not None:  # file order first (mixes days), then rows through the buffer
            order = torch.randperm(len(self.index.files), generator=gen).tolist()
        chunks = self.index.chunks(self.lo, self.hi, self.read_rows, self.cfg, order)
        bx, by = None, np.zeros(0, np.float32)
        for x, y in chunks:  # the width is the family's: taken from the first chunk
            bx, by = (x if bx is None else np.concatenate([bx, x])), np.concatenate([by, y])
            self.peak_buffer = max(self.peak_buffer, len(by))
            if gen is None:
                full = len(by) // batch_size * batch_size
            elif len(by) >= self.buffer_rows:
                perm = torch.randperm(len(by), generator=gen).numpy()
                bx, by = bx[perm], by[perm]
                # emit down to half the buffer: the rest mixes with the next chunks
                full = max(0, len(by) - self.buffer_rows // 2) // batch_size * batch_size
            else:
                continue
            yield from _split(bx[:full], by[:full], batch_size)
            bx, by = bx[full:], by[full:]
        if len(by):
            if gen is not None:
                perm = torch.randperm(len(by), generator=gen).numpy()
                bx, by = bx[perm], by[perm]
            yield from _split(bx, by, batch_size)


def _split(x: np.ndarray, y: np.ndarray, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, len(y), batch_size):
        yield torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size])), torch.from_numpy(y[i : i + batch_size])


@dataclass(frozen=True)
class StreamSplit:
    """A window's rows as consecutive ranges of the lake order, the newest last: train, val, holdout.
    `index` is the whole window (its lineage, and reads across ranges such as "every row before the holdout")."""

    index: LakeIndex
    train: LakeStream
    val: LakeStream
    holdout: LakeStream


def stream_split(
    lake_uri: str,
    end_day: str,
    cfg: ModelConfig,
    *,
    days: int | None = None,
    start_day: str | None = None,
    slot: str | None = None,
    holdout_fraction: float = 0.0,
    val_fraction: float = 0.0,
    min_rows: int = 1,
    read_rows: int = 65_536,
    buffer_rows: int = 262_144,
) -> StreamSplit:
    """train / val / holdout LakeStreams over a window: the newest `holdout_fraction` of the rows hold
    out, the newest `val_fraction` of the rest validate (rounded as time_split rounds)."""
    index = LakeIndex(lake_uri, end_day, days=days, start_day=start_day, slot=slot)
    if index.rows < min_rows:
        raise PipelineError(
            f"only {index.rows} rows for slot={slot!r} in the window ending {end_day} "
            f"({len(index.files)} files); need at least {min_rows}"
        )
    cut_h = int(round(index.rows * (1.0 - holdout_fraction)))
    cut_v = int(round(cut_h * (1.0 - val_fraction)))

    def stream(lo: int, hi: int) -> LakeStream:
        return LakeStream(index, lo, hi, cfg, read_rows, buffer_rows)

    return StreamSplit(index, train=stream(0, cut_v), val=stream(cut_v, cut_h), holdout=stream(cut_h, index.rows))


def holdout_streams(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str, model_cfg) -> StreamSplit:
    """train / val / holdout streams of a slot's window (every slot's rows with `lora.train_rows: all`): the one
    definition that training and the evaluation stage share, so both see exactly the same holdout rows. A candidate
    judged on the next day (`lora.judged_on: next_day`) holds nothing out: its holdout is empty."""
    lc = cfg.lora
    rows_of = slot if lc.train_rows == "slot" else None
    return stream_split(
        lake_uri,
        end_day,
        model_cfg,
        days=lc.window_days,
        slot=rows_of,
        holdout_fraction=lc.holdout_fraction if lc.judged_on == "holdout" else 0.0,
        val_fraction=lc.val_fraction,
        min_rows=lc.min_rows,
    )
