"""The HTTP front of an AdapterServer (`python -m pipelines serve`): FastAPI on uvicorn.

* `POST /invocations`: MLflow's scoring protocol (`serving.protocol`); answers `{"predictions": [...],
  "served_by": [{"model", "version"}, ...]}` in row order. A request the protocol refuses gets its
  4xx and a message (MLflow's `{"error_code", "message"}` shape); 503 until the first refresh has read
  the registry (the base alone would answer every row). A 500 is a bug, and counted.
* `GET /healthz`: 200 once every watched alias is loaded, else 503 with the reason.
* `GET /routes`: what serves now, the serving base and whether its alias moved, the last refresh.
* `GET /metrics`: Prometheus text (`lora_*`).
* `POST /webhooks/mlflow`: MLflow registry webhooks (`model_version_alias.created` / `.deleted`). The
  HMAC signature (`X-MLflow-Signature: v1,<base64 sha256 of "<delivery id>.<timestamp>.<body>">`), a
  timestamp within 5 minutes and an unseen delivery id are required; the payload itself is only a
  hint: the follower re-reads the alias it names from the registry, so a forged call cannot choose a route.

Decoding, parsing, scoring and encoding run on worker threads, as many at a time as there are cores
(torch releases the GIL; the router is thread-safe); the event loop only moves bytes, and the status
endpoints are async so a busy pool never makes the server look dead.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
import anyio
from starlette.requests import ClientDisconnect

from pipelines.errors import SchemaError
from pipelines.serving import protocol
from pipelines.serving.follow import Follower
from pipelines.serving.protocol import RequestError
from pipelines.serving.router import AdapterServer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 5 * 1024 * 1024
DRAIN_BYTES = 64 * 1024 * 1024
WEBHOOK_MAX_AGE_S = 300
_STAMP = re.compile(r"[0-9]{1,12}")
_ALIAS_EVENTS = frozenset({("model_version_alias", "created"), ("model_version_alias", "deleted")})


def create_app(
    server: AdapterServer,
    follower: Follower,
    *,
    webhook_secret: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_rows: int = protocol.MAX_ROWS,
    workers: int | None = None,
) -> FastAPI:
    """The app; `webhook_secret` None turns the webhook endpoint off (404): polling alone follows.
    `workers` requests are scored at a time (default: the CPU count); the rest wait on the event loop."""
    app = FastAPI(title="CTR LoRA adapter serving", docs_url=None, redoc_url=None, openapi_url=None)
    # Parsing and encoding hold the GIL: more scoring threads than cores only make them (and the
    # follower's refresh) take turns, so concurrency beyond the cores queues before a thread is taken.
    scoring = anyio.CapacityLimiter(workers or os.cpu_count() or 1)

    deliveries = _Deliveries()

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        if request.url.path == "/invocations":
            server.metrics.requests.labels(status=str(exc.status)).inc()
        return JSONResponse({"error_code": "BAD_REQUEST", "message": str(exc)}, status_code=exc.status)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        if request.url.path == "/invocations":
            server.metrics.requests.labels(status="500").inc()
        return JSONResponse(
            {"error_code": "INTERNAL_ERROR", "message": f"{type(exc).__name__}: {exc}"}, status_code=500
        )

    @app.post("/invocations")
    async def invocations(request: Request):
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise RequestError("Content-Type must be application/json", 415)
        if follower.state()["report"] is None:
            raise RequestError(f"not ready: {follower.ready()[1]}", 503)
        body = await _read_body(request, max_body_bytes)
        out = await anyio.to_thread.run_sync(_invoke, server, body, max_rows, limiter=scoring)
        server.metrics.requests.labels(status="200").inc()
        return Response(out, media_type="application/json")

    @app.get("/healthz")
    async def healthz():
        ready, why = follower.ready()
        return JSONResponse({"ready": ready, "reason": why}, status_code=200 if ready else 503)

    @app.get("/routes")
    async def routes():
        state = follower.state()
        report = state.pop("report") or {}
        return {
            "routes": server.routes(),
            "base": report.get("base", {"serving": server.base_ref.key}),
            "loaded": server.loaded_versions(),
            "refused": report.get("refused", []),
            "refresh": state,
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/webhooks/mlflow")
    async def webhook(request: Request):
        if webhook_secret is None:
            return JSONResponse({"message": "webhooks are off (no secret configured)"}, status_code=404)
        body = await _read_body(request, 64 * 1024)
        delivery = _verify(request.headers, body, webhook_secret)
        event = _decode(body)
        if not deliveries.first(delivery):
            return {"accepted": False, "reason": "delivery already received"}
        if isinstance(event, dict) and (event.get("entity"), event.get("action")) in _ALIAS_EVENTS:
            follower.poke("webhook", _route(event.get("data")))
        return {"accepted": True}

    return app


def _route(data: object) -> tuple[str, str] | None:
    """(model, alias) an alias event names, or None (then the follower re-reads every alias)."""
    if isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("alias"), str):
        return data["name"], data["alias"]
    return None


def _invoke(server: AdapterServer, body: bytes, max_rows: int) -> bytes:
    """The response body of one scoring request (on a pool thread: none of it runs on the event loop)."""
    frame = protocol.parse(_decode(body), required=server.required_columns, slots=server.slots, max_rows=max_rows)
    if len(frame) == 0:
        return b'{"predictions": [], "served_by": []}'
    try:
        predictions, keys = server.score(frame, return_versions=True)
    except SchemaError as exc:  # a column the family needs that the protocol let through
        raise RequestError(str(exc), 422) from exc
    versions, counts = np.unique(keys.astype(str), return_counts=True)
    for key, n in zip(versions, counts):
        server.metrics.rows_scored.labels(version=key).inc(int(n))
    served = {k: _served_by(k) for k in versions}
    return json.dumps({"predictions": predictions.tolist(), "served_by": [served[k] for k in keys]}).encode()


def _served_by(key: str) -> dict[str, str]:
    model, _, version = key.rpartition(":")
    return {"model": model, "version": version}


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or RequestError 413 past `limit` bytes. An oversized body is read to its end (and
    dropped) up to DRAIN_BYTES: answering mid-upload makes most clients see a reset, not the 413."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                if size > DRAIN_BYTES:
                    break
                continue
            chunks.append(chunk)
    except ClientDisconnect as exc:  # nobody is left to answer
        raise RequestError("the client went away mid-upload") from exc
    if size > limit:
        raise RequestError(f"the body is over {limit} bytes ({size:,} read)", 413)
    return b"".join(chunks)


def _decode(body: bytes) -> object:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested deep
        raise RequestError(f"the body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _verify(headers, body: bytes, secret: str) -> str:
    """The delivery id, once MLflow's signature over `<delivery id>.<timestamp>.<body>` matches and the
    timestamp is within WEBHOOK_MAX_AGE_S of now; RequestError 401 otherwise."""
    delivery, stamp = headers.get("x-mlflow-delivery-id", ""), headers.get("x-mlflow-timestamp", "")
    signature = headers.get("x-mlflow-signature", "")
    if not (delivery and _STAMP.fullmatch(stamp) and signature.startswith("v1,")):
        raise RequestError("missing or malformed X-MLflow-Delivery-Id / -Timestamp / -Signature headers", 401)
    if abs(time.time() - int(stamp)) > WEBHOOK_MAX_AGE_S:
        raise RequestError(f"the delivery's timestamp is more than {WEBHOOK_MAX_AGE_S} s from now", 401)
    signed = f"{delivery}.{stamp}.".encode("latin-1") + body  # headers arrive as latin-1 text
    expected = base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest())
    if not hmac.compare_digest(expected, signature[3:].encode("latin-1")):
        raise RequestError("the webhook signature does not match", 401)
    return delivery


class _Deliveries:
    """Delivery ids seen within the timestamp window: a captured delivery replayed is answered, not acted on."""

    def __init__(self, keep_s: float = 2 * WEBHOOK_MAX_AGE_S):
        self.keep_s, self._seen, self._lock = keep_s, collections.OrderedDict(), threading.Lock()

    def first(self, delivery: str) -> bool:
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.keep_s:
                self._seen.popitem(last=False)
            if delivery in self._seen:
                return False
            self._seen[delivery] = now
            return True
