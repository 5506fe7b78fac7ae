"""A per-model mutex around alias moves, held in the tracking store's own database.

MLflow has no compare-and-set for aliases: two concurrent "read the champion, move it, record the
move" sequences can interleave so that the alias ends on one writer's version while the history's
last entry is the other's. The lock makes each sequence atomic:

* PostgreSQL tracking store: a session-level advisory lock (`pg_advisory_lock`) keyed by the model
  name, on the same database MLflow uses, so it holds across processes and machines;
* SQLite: an exclusive `flock` on a file next to the database (a SQLite store is one machine);
* anything else (an MLflow tracking server over HTTP): a machine-local file lock, and a warning:
  across machines, registry writes are serialised by the Airflow pool `ctr_registry` (one slot).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from pipelines.errors import PromotionError

log = logging.getLogger(__name__)

POOL = "ctr_registry"
_engines: dict = {}
_warned: set[str] = set()


def lock_key(name: str) -> int:
    """A stable signed 63-bit key for pg_advisory_lock."""
    return int.from_bytes(hashlib.sha256(f"ctr-alias:{name}".encode()).digest()[:8], "big") >> 1


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PromotionError(f"timed out after {timeout_s:.0f} s waiting for the registry lock {path}")
                time.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _pg_lock(uri: str, name: str, timeout_s: float):
    import sqlalchemy as sa

    if uri not in _engines:
        _engines[uri] = sa.create_engine(uri, poolclass=sa.pool.NullPool)
    with _engines[uri].connect() as conn:
        conn.execute(sa.text(f"SET lock_timeout = '{int(timeout_s * 1000)}ms'"))
        try:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": lock_key(name)})
        except sa.exc.OperationalError as exc:
            raise PromotionError(f"timed out after {timeout_s:.0f} s waiting for the registry lock of {name}") from exc
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": lock_key(name)})
            conn.commit()


_held = threading.local()


@contextlib.contextmanager
def registry_lock(name: str, timeout_s: float = 60.0):
    """Hold the alias lock of registered model `name` for the duration of the block.

    Re-entrant within a thread (revert holds it while choosing its target and moving the alias).
    """
    held = getattr(_held, "names", None)
    if held is None:
        held = _held.names = {}
    if held.get(name):
        held[name] += 1
        try:
            yield
        finally:
            held[name] -= 1
        return
    held[name] = 1
    try:
        with _acquire(name, timeout_s):
            yield
    finally:
        held[name] = 0


@contextlib.contextmanager
def _acquire(name: str, timeout_s: float):
    import mlflow

    uri = mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme == "postgresql":
        with _pg_lock(uri, name, timeout_s):
            yield
        return
    if scheme == "sqlite":
        db = Path(uri.split(":///", 1)[1]) if ":///" in uri else Path(tempfile.gettempdir()) / "mlflow-memory"
        with _file_lock(db.with_name(db.name + f".{lock_key(name):x}.lock"), timeout_s):
            yield
        return
    if uri not in _warned:
        _warned.add(uri)
        log.warning("registry lock for %s is machine-local: across machines, alias moves rely on the Airflow "
                    "pool %r (one slot)", uri, POOL)
    local = Path(os.environ.get("CTR_LOCK_DIR", tempfile.gettempdir())) / f"ctr-alias-{lock_key(uri + name):x}.lock"
    with _file_lock(local, timeout_s):
        yield
