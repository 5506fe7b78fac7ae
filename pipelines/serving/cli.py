"""`python -m pipelines serve`: the HTTP scoring server (serving.http) that follows the registry.

Polling is always on (`--poll-seconds`); with a webhook secret (`CTR_SERVING_WEBHOOK_SECRET`) MLflow's
alias webhooks make a move visible at once. `--register-webhook URL` creates (or updates) that
webhook in the registry and exits. The `mlflow server` that sends it must allow plain-HTTP, private
addresses when it calls a server on the same network (MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https,
MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true), and keep MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY fixed across
restarts (docs/runbook.md, "Serving").
"""

from __future__ import annotations

import json
import logging
import os
import time

from pipelines.config import load_gate_policy, load_pipeline_config
from pipelines.errors import ConfigError, RegistryError

WEBHOOK_NAME = "ctr-serving-alias-moves"
WEBHOOK_EVENTS = ("model_version_alias.created", "model_version_alias.deleted")
SECRET_ENV = "CTR_SERVING_WEBHOOK_SECRET"
log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """Add `serve` to the subparsers `sub` of `python -m pipelines`."""
    s = sub.add_parser("serve", help="the HTTP scoring server: MLflow's /invocations protocol, following the registry")
    s.add_argument("--config")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--poll-seconds", type=float, default=10.0, help="registry polling interval (the fallback)")
    s.add_argument(
        "--canary-share", type=float, help="share of users sent to @canary (default: canary_share of the gate policy)"
    )
    s.add_argument("--policy", help="gate policy file (for its canary_share)")
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        help="requests scored at a time (default: the CPU count; more only make them and the "
        "registry follower take turns for the GIL)",
    )
    s.add_argument(
        "--load-budget-ms",
        type=float,
        default=None,
        help="once a refresh's loads took this long, install the moves already loaded and switch the "
        "rest when loaded (default 100)",
    )
    s.add_argument(
        "--max-loaded-adapters",
        type=int,
        default=None,
        help="adapter versions held in memory: routed ones always, idle ones (a fast revert) up to "
        "this many in all, least recently routed evicted first (default 16)",
    )
    s.add_argument(
        "--register-webhook",
        metavar="URL",
        help=f"instead: create or update the registry webhook that calls URL (secret: ${SECRET_ENV})",
    )
    s.set_defaults(fn=cmd)


def cmd(a) -> int:
    secret = os.environ.get(SECRET_ENV) or None
    if a.register_webhook:
        if not secret:
            raise ConfigError(f"--register-webhook needs ${SECRET_ENV} (the HMAC secret both sides share)")
        print(json.dumps(register_webhook(a.register_webhook, secret)))
        return 0
    cfg = load_pipeline_config(a.config)
    share = a.canary_share if a.canary_share is not None else load_gate_policy(a.policy).canary_share
    serve(
        cfg,
        host=a.host,
        port=a.port,
        poll_seconds=a.poll_seconds,
        canary_share=share,
        webhook_secret=secret,
        max_loaded_adapters=a.max_loaded_adapters,
        load_budget_ms=a.load_budget_ms,
        workers=a.workers,
    )
    return 0


def serve(
    cfg,
    *,
    host: str,
    port: int,
    poll_seconds: float,
    canary_share: float,
    webhook_secret: str | None,
    max_loaded_adapters: int | None = None,
    load_budget_ms: float | None = None,
    workers: int | None = None,
) -> None:
    """Load the base and the aliases, then serve until interrupted (SIGINT / SIGTERM)."""
    import uvicorn

    from pipelines.serving.follow import Follower
    from pipelines.serving.http import create_app
    from pipelines.serving.router import AdapterServer

    logging.getLogger("pipelines.serving").setLevel(logging.INFO)  # loads, refusals, routing tables
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a server's log, not a terminal
    limits = {
        k: v
        for k, v in (("max_loaded_adapters", max_loaded_adapters), ("load_budget_ms", load_budget_ms))
        if v is not None
    }
    server = _first_base(
        lambda: AdapterServer.from_config(cfg, canary_share=canary_share, refresh_now=False, **limits), poll_seconds
    )
    follower = Follower(server, interval_s=poll_seconds)
    follower.refresh("start")  # a registry it cannot read leaves /healthz at 503 until a tick succeeds
    follower.start()
    try:
        app = create_app(server, follower, webhook_secret=webhook_secret, workers=workers)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        follower.stop()


def _first_base(make, poll_seconds: float):
    """`make()` once the registry has a loadable base: a new deployment starts before its first
    ctr_base@champion exists, and waits for it rather than exiting (and restarting) in a loop."""
    while True:
        try:
            return make()
        except RegistryError as exc:
            log.warning("waiting for a serving base (retry in %.0f s): %s", poll_seconds, exc)
            time.sleep(poll_seconds)


def register_webhook(url: str, secret: str) -> dict:
    """Create the alias-move webhook calling `url`, or update the one of the same name (idempotent)."""
    from mlflow import MlflowClient

    client = MlflowClient()
    existing, token = [], None
    while True:  # every page: a registry may hold many webhooks
        page = client.list_webhooks(max_results=100, page_token=token)
        existing += [w for w in page if w.name == WEBHOOK_NAME]
        token = page.token
        if not token:
            break
    if existing:
        hook = client.update_webhook(
            existing[0].webhook_id, url=url, events=list(WEBHOOK_EVENTS), secret=secret, status="ACTIVE"
        )
    else:
        hook = client.create_webhook(
            WEBHOOK_NAME,
            url,
            list(WEBHOOK_EVENTS),
            secret=secret,
            description="CTR serving: refresh the routes when an alias moves",
        )
    return {"webhook_id": hook.webhook_id, "name": hook.name, "url": hook.url, "events": [str(e) for e in hook.events]}
