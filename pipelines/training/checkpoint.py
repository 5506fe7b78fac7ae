"""Training checkpoints: one file per run, rewritten after every epoch, under a local directory or an
s3:// prefix, so that a killed training task resumes where it stopped when it is re-run.

The file (`checkpoint.pt`, torch serialisation read back with `weights_only=True`, so a tampered
object cannot run code) holds what the loop needs to continue bit-exactly: the trainable weights,
the optimizer state, step and epoch, every RNG state (the loop's shuffling generator, torch, numpy,
random), the run key (settings + config + data/base identity) and the best-so-far weights.

Writes are atomic: locally a temp file in the same directory, fsynced, then `os.replace`; on S3 a
single PUT, which is atomic per object (a reader sees the old or the new object, never a part).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

from pipelines.data.lake import Lake, split_s3
from pipelines.errors import LakeError

log = logging.getLogger(__name__)

FILENAME = "checkpoint.pt"
FORMAT = 1
ROOT_ENV = "CTR_CHECKPOINT_ROOT"


def default_root(lake_uri: str) -> str:
    """Where checkpoints go unless told: $CTR_CHECKPOINT_ROOT, else `<lake>/_checkpoints`.

    The lake is the one location every worker of a deployment can reach, so an Airflow retry that
    lands on another worker still finds the checkpoint (a local cache dir would not). `_checkpoints`
    is not a `dt=` partition, so lake readers and validation never see it; adapter training deletes
    its checkpoint once the model is logged, so the prefix does not grow.
    """
    return os.environ.get(ROOT_ENV) or f"{lake_uri.rstrip('/')}/_checkpoints"


def default_uri(root: str, model_name: str, end_day: str, config_hash: str) -> str:
    """Deterministic per (model, end day, config): the same Airflow task finds the same checkpoint."""
    return f"{root.rstrip('/')}/{model_name}/{end_day}/{config_hash[:16]}"


# ------------------------------------------------------------------------------------ RNG states
def capture_rng(gen: torch.Generator) -> dict:
    """Every RNG the loop touches, in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "generator": gen.get_state(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "random": random.getstate(),
    }


def restore_rng(state: dict, gen: torch.Generator) -> None:
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    random.setstate(state["random"])


def serialize(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(payload: bytes) -> dict:
    return torch.load(io.BytesIO(payload), weights_only=True)


# ------------------------------------------------------------------------------------ the store
class CheckpointStore:
    """The checkpoint of one training run at `uri` (a local directory or an s3:// prefix)."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        if self.uri.startswith("file://"):
            self.uri = self.uri[len("file://") :]
        self.is_s3 = self.uri.startswith("s3://")
        self._lake = Lake(self.uri) if self.is_s3 else None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    @property
    def location(self) -> str:
        return f"{self.uri}/{FILENAME}"

    def save(self, state: dict) -> str:
        payload = serialize({**state, "format": FORMAT})
        if self.is_s3:
            return self._lake.put_bytes(FILENAME, payload)
        d = Path(self.uri)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{FILENAME}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, d / FILENAME)
        try:  # make the rename itself durable (a crash right after must not bring the old file back)
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        return self.location

    def load(self) -> dict | None:
        """The saved state, or None when there is none. An unreadable file is logged and ignored:
        starting over is always correct, only slower."""
        try:
            payload = self._lake.get_bytes(FILENAME) if self.is_s3 else Path(self.location).read_bytes()
        except (LakeError, FileNotFoundError):
            return None
        try:
            state = deserialize(payload)
        except Exception as exc:  # truncated or foreign file: torch raises several types
            log.warning("ignoring unreadable checkpoint %s: %s", self.location, exc)
            return None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            log.warning(
                "ignoring checkpoint %s: unknown format %r",
                self.location,
                state.get("format") if isinstance(state, dict) else type(state).__name__,
            )
            return None
        return state

    def delete(self) -> None:
        if self.is_s3:
            bucket, key = split_s3(self.location)
            try:
                self._lake.client.delete_object(Bucket=bucket, Key=key)
            except Exception as exc:  # botocore errors; a leftover checkpoint is harmless
                log.warning("could not delete checkpoint %s: %s", self.location, exc)
            return
        Path(self.location).unlink(missing_ok=True)


def key_digest(key: dict) -> str:
    """Short hash of a run key, for log lines."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
