#!/usr/bin/env python3
"""Write the `.env` that docker-compose.yml needs: every secret generated on this machine, never a default.

    python3 scripts/compose_env.py            # creates .env (mode 0600) or adds what it lacks
    python3 scripts/compose_env.py --check    # only says whether .env is complete and sound
    docker compose up -d

docker-compose.yml reads each secret as `${NAME:?…}`, so compose refuses to start without this file.
A value already in .env is kept (rotating one is deleting its line and running this again; a password
that a service stored on first start, Postgres' or MLflow's admin, must then be changed there too).
A value that is a known default (airflow, minioadmin, the old example JWT secret, an empty Fernet key)
or not URL-safe is refused: the secrets go into connection URLs, an ini file and shell arguments.
Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import re
import secrets
import string
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "docker" / ".env.example"
ALNUM = string.ascii_letters + string.digits


def token(n: int) -> Callable[[], str]:
    """n random letters and digits (~5.95 bits each): no character that a URL, an ini file, compose's
    `$` interpolation or a shell argument would read specially, and none that looks like a flag."""
    return lambda: "".join(secrets.choice(ALNUM) for _ in range(n))


def fernet_key() -> str:
    """What cryptography's Fernet.generate_key() returns (urlsafe base64 of 32 random bytes), without
    needing cryptography on the machine that runs compose."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


# Each secret compose reads from .env, and how to make one. MINIO_ROOT_USER is S3's access key id.
SECRETS: dict[str, Callable[[], str]] = {
    "_AIRFLOW_WWW_USER_PASSWORD": token(24),
    "AIRFLOW__API_AUTH__JWT_SECRET": token(48),
    "AIRFLOW__API__SECRET_KEY": token(32),
    "FERNET_KEY": fernet_key,
    "POSTGRES_PASSWORD": token(32),
    "REDIS_PASSWORD": token(32),
    "MINIO_ROOT_USER": lambda: "ctr" + token(12)(),
    "MINIO_ROOT_PASSWORD": token(40),
    "MLFLOW_ADMIN_PASSWORD": token(24),
    "MLFLOW_FLASK_SERVER_SECRET_KEY": token(32),
    "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": fernet_key,
    "CTR_SERVING_WEBHOOK_SECRET": token(32),
}
# Not secret, but needed by compose and specific to this machine.
SETTINGS: dict[str, Callable[[], str]] = {
    "AIRFLOW_UID": lambda: str(os.getuid()) if hasattr(os, "getuid") else "50000",
    "_AIRFLOW_WWW_USER_USERNAME": lambda: "admin",
    "MLFLOW_ADMIN_USERNAME": lambda: "admin",
}
# Values published with Airflow's, MinIO's and MLflow's examples or earlier versions of this repo.
KNOWN_DEFAULTS = {
    "airflow",
    "minioadmin",
    "admin",
    "password",
    "password1234",
    "changeme",
    "ctr-local-dev-jwt-secret-change-me-please",
}
MIN_LENGTH = {"MLFLOW_ADMIN_PASSWORD": 12, "MINIO_ROOT_PASSWORD": 8, "MINIO_ROOT_USER": 3}
SAFE = re.compile(r"[A-Za-z0-9_=-]+")


def parse(text: str) -> dict[str, str]:
    """KEY=VALUE lines as compose reads .env (comments and blank lines skipped, one level of quotes)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def problems(values: dict[str, str]) -> list[str]:
    """What makes these secrets unfit to start the stack with; [] when none. Values are never echoed."""
    out = []
    for key in SECRETS:
        value = values.get(key)
        if value is None or value == "":
            out.append(f"{key} is missing or empty")
        elif value.lower() in KNOWN_DEFAULTS:
            out.append(f"{key} is a published default value")
        elif not SAFE.fullmatch(value):
            out.append(f"{key} has characters other than letters, digits, '_', '-', '='")
        elif len(value) < MIN_LENGTH.get(key, 16):
            out.append(f"{key} is shorter than {MIN_LENGTH.get(key, 16)} characters")
    for name in ("FERNET_KEY", "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"):
        key = values.get(name, "")
        if key and SAFE.fullmatch(key) and not _is_fernet_key(key):
            out.append(f"{name} is not a Fernet key (urlsafe base64 of 32 bytes)")
    return out


def _is_fernet_key(value: str) -> bool:
    try:
        return len(base64.urlsafe_b64decode(value.encode())) == 32
    except (ValueError, TypeError):
        return False


def missing_lines(values: dict[str, str]) -> tuple[list[str], list[str]]:
    """(KEY=VALUE lines for every setting and secret that `values` lacks, the names generated)."""
    lines, names = [], []
    for key, make in (*SETTINGS.items(), *SECRETS.items()):
        if not values.get(key):
            lines.append(f"{key}={make()}")
            names.append(key)
    return lines, names


def ensure(path: Path) -> list[str]:
    """Create `path` (0600, from docker/.env.example plus generated values) or append what it lacks.
    Returns the names generated. Raises SystemExit naming every problem, writing nothing, when a
    value already there is unfit (problems())."""
    existed = path.exists()
    current = parse(path.read_text()) if existed else {}
    # Empty lines for secrets in an existing file are filled in below; anything else unfit is refused.
    unfit = [p for p in problems(current) if not p.endswith("is missing or empty")]
    if unfit:
        raise SystemExit(
            f"{path}: " + "; ".join(unfit) + ".\nDelete those lines and run this again to "
            "generate new values (an existing Postgres volume keeps the password it was "
            "created with: `docker compose down -v`, or ALTER USER in it)."
        )
    lines, names = missing_lines(current)
    if not lines:
        return []
    stamp = f"# generated by scripts/compose_env.py on {dt.date.today().isoformat()}: keep out of git"
    if existed:
        text = path.read_text()
        sep = "" if text.endswith("\n") or not text else "\n"
        path.write_text(text + sep + "\n".join(["", stamp, *lines]) + "\n")
    else:
        template = TEMPLATE.read_text() if TEMPLATE.is_file() else ""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(
                template
                + ("\n" if template and not template.endswith("\n") else "")
                + "\n".join([stamp, *lines])
                + "\n"
            )
    os.chmod(path, 0o600)
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env-file", type=Path, default=REPO / ".env")
    ap.add_argument("--check", action="store_true", help="only check; exit 1 when anything is missing or unfit")
    args = ap.parse_args(argv)
    if args.check:
        found = problems(parse(args.env_file.read_text())) if args.env_file.exists() else ["no such file"]
        for p in found:
            print(f"{args.env_file}: {p}", file=sys.stderr)
        return 1 if found else 0
    names = ensure(args.env_file)
    print(f"{args.env_file}: " + (f"generated {', '.join(names)}" if names else "complete, nothing changed"))
    print(
        "Logins: Airflow user _AIRFLOW_WWW_USER_USERNAME / _AIRFLOW_WWW_USER_PASSWORD, MLflow "
        "MLFLOW_ADMIN_USERNAME / MLFLOW_ADMIN_PASSWORD, MinIO MINIO_ROOT_USER / MINIO_ROOT_PASSWORD (in that file)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
