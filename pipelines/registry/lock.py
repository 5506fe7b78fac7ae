"""A per-model mutex around alias moves that holds across processes and machines.

MLflow has no compare-and-set for aliases: two concurrent "read the champion, move it, record the
move" sequences can interleave so that the alias ends on one writer's version while the history's
last entry is the other's. The lock makes each sequence atomic. Where it lives:

* `CTR_REGISTRY_LOCK_URL` set (required with an MLflow tracking server over HTTP):
  - `postgresql://…` (or `postgresql+psycopg2://…`): a session-level advisory lock
    (`pg_advisory_lock`) on that database; any database every writer can reach, e.g. the tracking
    server's own backend database. Released by PostgreSQL if the holder's connection dies.
  - `redis://host:port/db` (or `rediss://`): a `redis.lock.Lock` with a TTL of `REDIS_TTL_S`,
    renewed every third of it while held, so a holder that dies (no connection to release it with)
    blocks the others for at most one TTL. A holder cut off from Redis for longer than the TTL loses
    the lock; the block then ends with a PromotionError (the move may have raced: check the history).
  - any other scheme: a PromotionError.
* unset, PostgreSQL tracking store: the advisory lock on the tracking database itself;
* unset, SQLite tracking store: an exclusive `flock` on a file next to the database (a SQLite store
  is one machine);
* unset, anything else (an HTTP tracking server, a file store): every alias move is refused with a
  PromotionError naming CTR_REGISTRY_LOCK_URL. A machine-local lock would let two machines (Airflow
  workers) move the same alias at once; the Airflow pool `ctr_registry` (named in
  `ctr_airflow.dag_defaults.REGISTRY_POOL`; nothing here needs it) serialises only one Airflow's
  tasks, not the CLI, the monitor run by hand or a second deployment.

Keys: the advisory-lock key is `lock_key(model)` on every PostgreSQL backend, so processes that lock
through the tracking database and processes that name the same database in CTR_REGISTRY_LOCK_URL
exclude each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import mlflow
import redis
import sqlalchemy as sa
from redis.lock import Lock

from pipelines.errors import PromotionError

LOCK_URL_ENV = "CTR_REGISTRY_LOCK_URL"
# A dead holder blocks the others for at most this long; renewed every third of it while held.
REDIS_TTL_S = 30.0
REDIS_KEY_PREFIX = "ctr:registry-lock:"
_engines: dict = {}


def lock_key(name: str) -> int:
    """A stable signed 63-bit key for pg_advisory_lock."""
    return int.from_bytes(hashlib.sha256(f"ctr-alias:{name}".encode()).digest()[:8], "big") >> 1


def redacted(url: str) -> str:
    """`url` without its password (lock and tracking URLs end up in errors and task logs)."""
    p = urlparse(url)
    if not p.password:
        return url
    return urlunparse(p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@", 1)))


def backend() -> tuple[str, str]:
    """(kind, location) of the lock alias moves take now: ("postgresql", URL), ("redis", URL) or
    ("file", the SQLite database's path). Raises PromotionError when there is none that holds across machines."""
    url = os.environ.get(LOCK_URL_ENV, "").strip()
    if url:
        scheme = urlparse(url).scheme.lower()
        if scheme in ("postgres", "postgresql") or scheme.startswith("postgresql+"):
            # SQLAlchemy only knows the postgresql:// spelling.
            return "postgresql", ("postgresql:" + url.split(":", 1)[1] if scheme == "postgres" else url)
        if scheme in ("redis", "rediss"):
            return "redis", url
        raise PromotionError(
            f"{LOCK_URL_ENV}={redacted(url)!r} has an unknown scheme {scheme!r}: expected "
            "postgresql://… (an advisory lock) or redis://host:port/db; refusing to move aliases"
        )
    uri = mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme == "postgresql":
        return "postgresql", uri
    if scheme == "sqlite":
        db = Path(uri.split(":///", 1)[1]) if ":///" in uri else Path(tempfile.gettempdir()) / "mlflow-memory"
        return "file", str(db)
    raise PromotionError(
        f"no registry lock that holds across machines for the tracking store {redacted(uri)!r}: set "
        f"{LOCK_URL_ENV} to postgresql://… (e.g. the tracking server's backend database) or redis://host:port/db, "
        "the same for every process that moves aliases; refusing to move aliases without it"
    )


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float):
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
    if uri not in _engines:
        _engines[uri] = sa.create_engine(uri, poolclass=sa.pool.NullPool)
    try:
        conn = _engines[uri].connect()
    except sa.exc.SQLAlchemyError as exc:  # fail closed: no lock, no move
        raise PromotionError(
            f"cannot reach the registry lock database {redacted(uri)}: {exc.__class__.__name__}; "
            f"refusing to move aliases of {name}"
        ) from exc
    with conn:
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


def _redis_acquire(url: str, name: str, timeout_s: float):
    """(client, held Lock) or PromotionError. thread_local=False: the renewal thread needs the token."""
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    lock = Lock(
        client,
        f"{REDIS_KEY_PREFIX}{name}",
        timeout=REDIS_TTL_S,
        sleep=0.02,
        blocking_timeout=timeout_s,
        thread_local=False,
    )
    try:
        got = lock.acquire()
    except redis.exceptions.RedisError as exc:
        client.close()
        raise PromotionError(
            f"cannot reach the registry lock at {redacted(url)}: {exc}; refusing to move aliases of {name}"
        ) from exc
    if not got:
        client.close()
        raise PromotionError(
            f"timed out after {timeout_s:.0f} s waiting for the registry lock of {name} at {redacted(url)}"
        )
    return client, lock


@contextlib.contextmanager
def _redis_lock(url: str, name: str, timeout_s: float):
    client, lock = _redis_acquire(url, name, timeout_s)
    stop, lost = threading.Event(), []

    def renew():
        while not stop.wait(REDIS_TTL_S / 3):
            try:
                lock.extend(REDIS_TTL_S, replace_ttl=True)
            except redis.exceptions.RedisError as exc:  # expired (LockNotOwnedError) or Redis unreachable
                lost.append(exc)
                return

    renewer = threading.Thread(target=renew, name=f"registry-lock-renew:{name}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        try:
            lock.release()
        except redis.exceptions.RedisError as exc:
            lost.append(exc)
        client.close()
    # Only reached when the block itself succeeded: its writes may have raced with another holder.
    if lost:
        raise PromotionError(
            f"the registry lock of {name} at {redacted(url)} was lost while held ({lost[0]}); "
            "another process may have moved its aliases meanwhile: check its history"
        )


_held = threading.local()


@contextlib.contextmanager
def registry_lock(name: str, timeout_s: float = 60.0):
    """Hold the alias lock of registered model `name` for the duration of the block.

    Re-entrant within a thread (revert holds it while choosing its target and moving the alias).
    Raises PromotionError, before the block runs, when no cross-machine lock is configured for the
    tracking store, the lock backend is unreachable, or the lock is not free within `timeout_s`.
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


def _acquire(name: str, timeout_s: float):
    kind, where = backend()
    if kind == "postgresql":
        return _pg_lock(where, name, timeout_s)
    if kind == "redis":
        return _redis_lock(where, name, timeout_s)
    db = Path(where)
    return _file_lock(db.with_name(db.name + f".{lock_key(name):x}.lock"), timeout_s)
