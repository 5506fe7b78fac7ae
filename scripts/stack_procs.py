"""The processes of `scripts/stack.py`: started in a session of their own, found by the PID file in
<dir>/pids/<name>.pid, logging to <dir>/logs/<name>.log, stopped with their whole process group.
Nothing here knows what the components are (stack.py does)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def pid_of(d: Path, comp: str) -> int | None:
    path = d / "pids" / f"{comp}.pid"
    try:
        pid = int(path.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def start(d: Path, comp: str, argv: list[str], env: dict, cwd: Path) -> str:
    if pid := pid_of(d, comp):
        return f"{comp}: already running (pid {pid})"
    (d / "logs").mkdir(parents=True, exist_ok=True)
    (d / "pids").mkdir(parents=True, exist_ok=True)
    log = open(d / "logs" / f"{comp}.log", "ab")
    # a session of its own: `down` stops the component and every child it forked in one signal
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    (d / "pids" / f"{comp}.pid").write_text(str(proc.pid))
    return f"{comp}: started (pid {proc.pid})"


def stop(d: Path, comp: str, grace_s: float = 20) -> str:
    pid = pid_of(d, comp)
    (d / "pids" / f"{comp}.pid").unlink(missing_ok=True)
    if pid is None:
        return f"{comp}: not running"
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    # the whole group: a Celery pool's or uvicorn's children may outlive their parent by a moment
    while time.monotonic() < deadline and (_alive(pid) or _group_alive(pid)):
        time.sleep(0.2)
    if _alive(pid) or _group_alive(pid):
        _signal_group(pid, signal.SIGKILL)
        return f"{comp}: killed (pid {pid})"
    return f"{comp}: stopped (pid {pid})"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child
        if waited:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def wait_http(url: str, timeout_s: float, what: str, proc_check=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc_check and not proc_check():
            break
        time.sleep(0.5)
    raise SystemExit(f"{what} did not become healthy at {url} within {timeout_s:.0f} s")
