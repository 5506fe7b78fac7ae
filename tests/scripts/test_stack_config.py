"""The settings of `make stack` (scripts/stack.py) and of docker-compose.yml agree on what matters
for a deployment: CeleryExecutor, one JWT secret, the registry lock URL on PostgreSQL, the lake's
connection, the worker preload, MLflow's logging and artifact proxying, the registry pool.

And docker-compose.yml ships no secret: each one is `${NAME:?…}` from the .env that
scripts/compose_env.py generates, compose (interpolated here as it does) refuses to start without
it, ports bind to 127.0.0.1 unless asked, and MLflow runs its basic-auth app, started here for real
from the compose file's own entrypoint with the generated credentials."""

from __future__ import annotations

import base64
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest
import yaml
from cryptography.fernet import Fernet
from mlflow.utils.validation import _validate_password

from pipelines.registry import mlflow_io
from tests.conftest import free_port, fresh_database, stop_mlflow_server
from tests.e2e.stack import REPO

SHARED = ("AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS", "MLFLOW_CONFIGURE_LOGGING", "CTR_LAKE_AWS_CONN_ID")


@pytest.fixture(scope="module")
def stack_mod():
    spec = importlib.util.spec_from_file_location("stack_script", REPO / "scripts" / "stack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_stack_env_is_the_production_topology(stack_mod, tmp_path):
    s = stack_mod.settings({"STACK_DIR": str(tmp_path), "STACK_API_PORT": "18080", "STACK_NAME": "x"})
    env = stack_mod.stack_env(s, {"PATH": "/bin"})
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18080/execution/"
    assert env["CTR_REGISTRY_LOCK_URL"].startswith("postgresql://") and env["CTR_REGISTRY_LOCK_URL"].endswith(
        "/x_mlflow"
    )
    assert env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert "CTR_MLFLOW_ARTIFACT_ROOT" not in env  # artifacts are proxied by the tracking server
    # one secret for every component, kept across restarts
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == stack_mod.stack_env(s, {})["AIRFLOW__API_AUTH__JWT_SECRET"]
    # every log server on a port of its own (scheduler, triggerer, two workers)
    ports = {
        stack_mod.component_env(s, env, c)["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] for c in ("worker-1", "worker-2")
    }
    ports |= {env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"], env["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"]}
    assert len(ports) == 4
    mlflow_cmd = stack_mod.commands(s)["mlflow"]
    assert "--serve-artifacts" in mlflow_cmd and any(a.startswith("postgresql://") for a in mlflow_cmd)


def test_the_stack_runs_the_documented_chain_and_serves(stack_mod, tmp_path):
    """DAGs start unpaused (a validated day's Asset event starts retrain, cold start and monitor), and the
    scoring server is one of the stack's processes, stopped last-started-first."""
    s = stack_mod.settings({"STACK_DIR": str(tmp_path), "STACK_SERVE_PORT": "18000"})
    assert stack_mod.stack_env(s, {})["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] == "False"
    serve = stack_mod.commands(s)["serve"]
    assert serve[1:4] == ["-m", "pipelines", "serve"] and serve[serve.index("--port") + 1] == "18000"
    assert stack_mod.ORDER[-1] == "serve" and "serve" not in stack_mod.AIRFLOW


def test_stack_env_keeps_the_callers_pythonpath_after_the_projects(stack_mod, tmp_path):
    """A user's own model family may live on their PYTHONPATH rather than in site-packages: the workers and
    the DAG processor inherit it, after the project's own paths (which it cannot shadow)."""
    s = stack_mod.settings({"STACK_DIR": str(tmp_path)})
    paths = stack_mod.stack_env(s, {"PYTHONPATH": os.pathsep.join(["/opt/mine", "", "/opt/theirs"])})["PYTHONPATH"]
    assert paths.split(os.pathsep) == [str(REPO / "plugins"), str(REPO), "/opt/mine", "/opt/theirs"]
    ours = [str(REPO / "plugins"), str(REPO)]
    assert stack_mod.stack_env(s, {})["PYTHONPATH"].split(os.pathsep) == ours
    again = stack_mod.stack_env(s, {"PYTHONPATH": paths})["PYTHONPATH"]  # a shell that sourced `stack.py env`
    assert again == paths


def test_compose_uses_the_same_settings(stack_mod, compose, tmp_path):
    env = stack_mod.stack_env(stack_mod.settings({"STACK_DIR": str(tmp_path)}), {})
    common = compose["x-airflow-common"]["environment"]
    assert common["AIRFLOW__CORE__EXECUTOR"].endswith(":-CeleryExecutor}")
    assert common["CTR_REGISTRY_LOCK_URL"].startswith("postgresql://")
    for key in SHARED:
        assert str(common[key]) == env[key], key
    # the connection that CTR_LAKE_AWS_CONN_ID names exists, as an AWS connection to the lake's endpoint
    lake_conn = common[f"AIRFLOW_CONN_{common['CTR_LAKE_AWS_CONN_ID'].upper()}"]
    assert '"conn_type": "aws"' in lake_conn and '"endpoint_url": "http://minio:9000"' in lake_conn
    assert "--serve-artifacts" in compose["services"]["mlflow"]["command"]
    assert compose["services"]["airflow-worker"]["deploy"]["replicas"] == "${AIRFLOW_WORKERS:-2}"
    assert "profiles" not in compose["services"]["redis"]
    assert "airflow pools set ctr_registry 1" in compose["services"]["airflow-init"]["command"][1]


def test_compose_config_is_valid_where_the_plugin_exists(tmp_path):
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine: the file is checked by the tests above only")
    base = [docker, "compose", "-f", str(REPO / "docker-compose.yml")]
    env_file = tmp_path / ".env"
    load_script("compose_env").ensure(env_file)
    proc = subprocess.run(
        [*base, "--env-file", str(env_file), "config", "-q"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    # without the generated secrets compose refuses, naming the script that makes them
    bare = {k: v for k, v in os.environ.items() if k not in load_script("compose_env").SECRETS}
    proc = subprocess.run(
        [*base, "--env-file", os.devnull, "config", "-q"], capture_output=True, text=True, cwd=tmp_path, env=bare
    )
    assert proc.returncode != 0 and "scripts/compose_env.py" in proc.stderr


# ----------------------------------------------------------------------------- no default secrets
COMPOSE_DOC = yaml.safe_load((REPO / "docker-compose.yml").read_text())
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRET_KEY = re.compile(r"PASSWORD|SECRET|FERNET|ACCESS_KEY|REDISCLI_AUTH")


class Refused(Exception):
    """What `docker compose` does for a `${NAME:?message}` whose variable is unset or empty."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?err},
    ${NAME?err}, and $$ for a literal $."""

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        unset = value is None or (value == "" and op and op.startswith(":"))
        if op in (":?", "?") and unset:
            raise Refused(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return value or ""

    parts = text.split("$$")
    return "$".join(_REF.sub(one, part) for part in parts)


def interpolate_doc(node, env: dict[str, str]):
    """The compose file as compose sees it: every string value substituted (keys and comments not)."""
    if isinstance(node, dict):
        return {k: interpolate_doc(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_doc(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


@pytest.fixture(scope="module")
def compose_env():
    return load_script("compose_env")


@pytest.fixture
def env_file(compose_env, tmp_path) -> Path:
    path = tmp_path / ".env"
    compose_env.ensure(path)
    return path


def services_env(doc: dict) -> dict[str, dict]:
    out = {"x-airflow-common": doc["x-airflow-common"]["environment"]}
    out.update({name: svc.get("environment") or {} for name, svc in doc["services"].items()})
    return out


def test_no_secret_has_a_default_in_compose(compose_env, compose):
    values = "\n".join(strings(compose))
    for literal in ("minioadmin", "change-me", "FERNET_KEY:-", ":-airflow}@", "redis://:@"):
        assert literal not in values, literal
    # `$${NAME}` is compose's escape for a shell variable of the container, not a substitution
    refs = {(m.group(1), m.group(2)) for part in values.split("$$") for m in _REF.finditer(part)}
    for name in compose_env.SECRETS:
        assert {op for n, op in refs if n == name} == {":?"}, f"{name}: every use must be ${{{name}:?…}}"
    # every secret-looking value of every service is made of required variables, nothing literal
    for service, env in services_env(compose).items():
        for key, value in env.items():
            if SECRET_KEY.search(key) and not key.endswith("_FILE"):  # a file's path is no secret
                names = {m.group(1) for m in _REF.finditer(str(value))}
                assert names and names <= set(compose_env.SECRETS), f"{service}.{key}"
                assert _REF.sub("", str(value)) == "", f"{service}.{key} has literal parts"


def test_every_secret_comes_from_the_env_file(compose_env, env_file):
    values = compose_env.parse(env_file.read_text())
    assert compose_env.problems(values) == []
    doc = interpolate_doc(COMPOSE_DOC, values)
    env = services_env(doc)
    common, mlflow_env = env["x-airflow-common"], env["mlflow"]
    used = "\n".join(strings(doc))
    for name in compose_env.SECRETS:  # each generated secret is used, and reaches a service
        assert values[name] in used, name
    for what in ("USERNAME", "PASSWORD"):  # Airflow's tasks log in as the admin the server creates
        client, server = common[f"MLFLOW_TRACKING_{what}"], mlflow_env[f"MLFLOW_AUTH_ADMIN_{what}"]
        assert client == server == values[f"MLFLOW_ADMIN_{what}"]
    assert common["AWS_SECRET_ACCESS_KEY"] == env["minio"]["MINIO_ROOT_PASSWORD"] == values["MINIO_ROOT_PASSWORD"]
    assert f":{values['POSTGRES_PASSWORD']}@postgres/mlflow_auth" in mlflow_env["MLFLOW_AUTH_DATABASE_URI"]
    assert f":{values['REDIS_PASSWORD']}@redis:6379/0" in common["AIRFLOW__CELERY__BROKER_URL"]
    # without the file, compose refuses to start (here: the substitution raises for a missing secret)
    for name in compose_env.SECRETS:
        with pytest.raises(Refused, match=name):
            interpolate_doc(COMPOSE_DOC, {k: v for k, v in values.items() if k != name})


def test_ports_bind_to_localhost_unless_asked(compose):
    published = [(name, port) for name, svc in compose["services"].items() for port in svc.get("ports", [])]
    assert {name for name, _ in published} == {"minio", "mlflow", "airflow-apiserver", "serving"}
    for name, port in published:
        assert str(port).startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
        assert interpolate(str(port), {}).startswith("127.0.0.1:"), (name, port)
        assert interpolate(str(port), {"BIND_ADDRESS": "0.0.0.0"}).startswith("0.0.0.0:")


def test_compose_env_generates_once_and_keeps_what_is_there(compose_env, tmp_path):
    path = tmp_path / ".env"
    assert set(compose_env.ensure(path)) == set(compose_env.SECRETS) | set(compose_env.SETTINGS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = compose_env.parse(path.read_text())
    Fernet(values["FERNET_KEY"].encode())  # a key Airflow can use
    _validate_password(values["MLFLOW_ADMIN_PASSWORD"])  # MLflow's own policy for its admin
    assert compose_env.ensure(path) == [] and compose_env.parse(path.read_text()) == values
    # a secret that is missing is added; the others stay as they were
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("REDIS_PASSWORD=")))
    assert compose_env.ensure(path) == ["REDIS_PASSWORD"]
    again = compose_env.parse(path.read_text())
    assert again["REDIS_PASSWORD"] != values["REDIS_PASSWORD"]
    assert {**again, "REDIS_PASSWORD": ""} == {**values, "REDIS_PASSWORD": ""}
    assert compose_env.main(["--check", "--env-file", str(path)]) == 0
    # a second machine gets other secrets
    other = compose_env.parse((compose_env.ensure(tmp_path / "b.env"), (tmp_path / "b.env").read_text())[1])
    assert all(other[k] != values[k] for k in compose_env.SECRETS)


@pytest.mark.parametrize(
    "line",
    [
        "POSTGRES_PASSWORD=airflow",
        "MINIO_ROOT_USER=minioadmin",
        "FERNET_KEY=abc",
        "AIRFLOW__API_AUTH__JWT_SECRET=ctr-local-dev-jwt-secret-change-me-please",
        "MLFLOW_ADMIN_PASSWORD=short",
        "REDIS_PASSWORD=has$dollar-and-more-than-16",
    ],
)
def test_compose_env_refuses_published_or_unfit_values(compose_env, tmp_path, line):
    path = tmp_path / ".env"
    path.write_text(line + "\n")
    with pytest.raises(SystemExit, match=line.split("=")[0]):
        compose_env.ensure(path)
    assert path.read_text() == line + "\n"  # nothing written
    assert compose_env.main(["--check", "--env-file", str(path)]) == 1


def test_the_example_file_holds_no_secret(compose_env):
    example = compose_env.parse((REPO / "docker" / ".env.example").read_text())
    assert not set(example) & set(compose_env.SECRETS)
    assert ".env" in (REPO / ".gitignore").read_text().split()


# ----------------------------------------------------------------------------- MLflow behind basic auth
def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_mlflow_runs_basic_auth_from_the_compose_entrypoint(compose_env, env_file, tmp_path, monkeypatch):
    """The compose mlflow service's entrypoint and command, run here: only the host, port, stores and
    artifact destination are this machine's. Anonymous calls get 401; the library, given the generated
    credentials as compose gives them to Airflow, works."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (Flask-WTF) is not installed: requirements.txt")

    values = compose_env.parse(env_file.read_text())
    svc = interpolate_doc(COMPOSE_DOC, values)["services"]["mlflow"]
    port = free_port()
    local = {
        "--host=0.0.0.0": "--host=127.0.0.1",
        "--port=5000": f"--port={port}",
        "--artifacts-destination=s3://ctr-lake/mlflow": f"--artifacts-destination={tmp_path / 'artifacts'}",
    }
    command = [
        str(Path(sys.executable).with_name("mlflow")),
        *(local.get(a, a) for a in svc["command"][1:]),
        "--workers",
        "1",
    ]
    assert "--app-name=basic-auth" in command and "--serve-artifacts" in command
    with fresh_database("ctr_test_mlflow_", tmp_path) as backend, fresh_database("ctr_test_auth_", tmp_path) as auth_db:
        env = {
            **os.environ,
            **{k: str(v) for k, v in svc["environment"].items()},
            "MLFLOW_BACKEND_STORE_URI": backend,
            "MLFLOW_AUTH_DATABASE_URI": auth_db,
            "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        log = open(tmp_path / "mlflow.log", "wb")
        proc = subprocess.Popen(
            [*svc["entrypoint"], *command],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _check_basic_auth(f"http://127.0.0.1:{port}", values, proc, tmp_path, monkeypatch)
        finally:
            stop_mlflow_server(proc)
            log.close()


def _check_basic_auth(uri: str, values: dict, proc, tmp_path: Path, monkeypatch) -> None:
    deadline = time.monotonic() + 120
    while _safe_status(f"{uri}/health") != 200:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()[-4000:]
        time.sleep(0.5)
    assert stat.S_IMODE((tmp_path / "basic_auth.ini").stat().st_mode) == 0o600
    assert values["MLFLOW_ADMIN_PASSWORD"] not in (tmp_path / "basic_auth.ini").read_text()
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
    admin = (values["MLFLOW_ADMIN_USERNAME"], values["MLFLOW_ADMIN_PASSWORD"])
    assert _status(search) == 401
    assert _status(search, (admin[0], "not-the-password")) == 401
    assert _status(search, admin) == 200

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin[1])
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(uri)
    try:
        assert mlflow_io.ensure_experiment("compose-auth-check")
        mlflow_io.client().create_registered_model("compose_auth_check")
        assert mlflow_io.version_by_alias("compose_auth_check", "champion") is None
    finally:
        mlflow.set_tracking_uri(None)


def _safe_status(url: str) -> int | None:
    try:
        return _status(url)
    except OSError:
        return None


def test_serving_follows_the_registry_with_a_signed_webhook(compose):
    """The serving service and the webhook it is registered for share one generated secret, and the
    tracking server may call it (plain HTTP on the compose network) with a fixed encryption key."""
    services = compose["services"]
    serving, init, mlflow_env = services["serving"], services["serving-init"], services["mlflow"]["environment"]
    assert serving["entrypoint"] == init["entrypoint"] == ["python", "-m", "pipelines"]
    assert serving["command"][0] == "serve" and "--register-webhook" in init["command"]
    hook = init["command"][init["command"].index("--register-webhook") + 1]
    assert hook.startswith("http://serving:8000/")
    assert init["environment"]["CTR_SERVING_WEBHOOK_SECRET"] == serving["environment"]["CTR_SERVING_WEBHOOK_SECRET"]
    assert mlflow_env["MLFLOW_WEBHOOK_ALLOWED_SCHEMES"] == "http,https"
    assert mlflow_env["MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS"] == "true"
    assert mlflow_env["MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY"].startswith("${MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY:?")
    assert "/healthz" in " ".join(serving["healthcheck"]["test"])
