"""Live metrics of a served model version over one day, for `ctr_champion_monitor`.

The labelled partitions tell how well a version *ranks* (AUC, logloss); only the serving side knows
what users actually did with what a version showed them (its live CTR). A source answers
`window_metrics(model, version, day) -> {name: value} | None` for the UTC day `day`.

`PrometheusSource` asks a Prometheus HTTP API (`GET /api/v1/query`) one instant query per metric,
evaluated at the end of the day. Queries are PromQL templates in which `{model}`, `{version}` and
`{day}` are replaced (plain substitution, not `str.format`: PromQL's own label matchers use braces).
A query whose result is empty or NaN yields no value (no traffic is not an error); a request that
fails, times out, or returns a non-success or malformed answer raises LiveMetricsError naming the
URL and the query. The monitor treats that as "no live metrics this window", never as a bad window.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request

from pipelines.config import GatePolicy
from pipelines.errors import ConfigError, PipelineError

# What a click-event exporter is expected to expose per served version (counters labelled model and
# version). The serving process itself only exports latency and swap counters (pipelines.serving.metrics).
DEFAULT_QUERIES: dict[str, str] = {
    "live_ctr": (
        'sum(increase(ctr_clicks_total{model="{model}",version="{version}"}[1d]))'
        ' / sum(increase(ctr_impressions_total{model="{model}",version="{version}"}[1d]))'
    ),
    "live_impressions": 'sum(increase(ctr_impressions_total{model="{model}",version="{version}"}[1d]))',
}
PLACEHOLDERS = ("{model}", "{version}", "{day}")


class LiveMetricsError(PipelineError):
    """A live-metrics source could not answer (unreachable, timeout, error status, malformed reply)."""

    def __init__(self, url: str, query: str, problem: str):
        self.url, self.query, self.problem = url, query, problem
        super().__init__(f"live metrics query failed at {url}: {problem} (query: {query})")


def end_of_day_unix(day: str) -> float:
    """Unix time of the end of UTC day `day` (= midnight of the next day): instant queries over a `[1d]`
    range evaluated there cover exactly that day."""
    d = dt.date.fromisoformat(day) + dt.timedelta(days=1)
    return dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc).timestamp()


def render_query(template: str, model: str, version: str, day: str) -> str:
    out = template
    for key, value in zip(PLACEHOLDERS, (model, str(version), day)):
        out = out.replace(key, value)
    return out


def parse_value(payload: dict, url: str, query: str) -> float | None:
    """The single number of a Prometheus instant-query answer; None for an empty vector or NaN."""
    if not isinstance(payload, dict):
        raise LiveMetricsError(url, query, f"reply is not a JSON object: {str(payload)[:200]}")
    if payload.get("status") != "success":
        detail = f"{payload.get('errorType', '')} {payload.get('error', '')}".strip()
        raise LiveMetricsError(url, query, f"status {payload.get('status')!r}: {detail}")
    data = payload.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        sample = result
    elif kind == "vector":
        if not isinstance(result, list):
            raise LiveMetricsError(url, query, f"vector result is not a list: {str(result)[:200]}")
        if not result:
            return None
        if len(result) > 1:
            # A monitor metric is one number per version and day; several series means the query does
            # not aggregate (e.g. a missing sum()), and picking one would be a silent guess.
            raise LiveMetricsError(url, query, f"{len(result)} series returned, expected one (aggregate the query)")
        sample = result[0].get("value") if isinstance(result[0], dict) else None
    else:
        raise LiveMetricsError(url, query, f"unsupported resultType {kind!r} (expected vector or scalar)")
    try:
        value = float(sample[1])
    except (TypeError, ValueError, IndexError) as exc:
        raise LiveMetricsError(url, query, f"malformed sample {str(sample)[:200]}") from exc
    return None if math.isnan(value) or math.isinf(value) else value


def _error_text(body: bytes) -> str:
    try:
        payload = json.loads(body)
        return f"{payload.get('errorType', '')}: {payload.get('error', '')}".strip(": ")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


class PrometheusSource:
    """Live metrics from a Prometheus HTTP API: one instant query per entry of `queries`."""

    def __init__(self, base_url: str, queries: dict[str, str] | None = None, timeout_s: float = 10.0):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"Prometheus base URL must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0:
            raise ConfigError(f"Prometheus timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.queries = dict(DEFAULT_QUERIES if queries is None else queries)
        self.timeout_s = timeout_s

    def query(self, promql: str, at: float) -> float | None:
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            # Prometheus answers 400 / 422 / 503 with a JSON body naming the problem: keep it.
            raise LiveMetricsError(self.base_url, promql, f"HTTP {exc.code}: {_error_text(exc.read())}") from exc
        except (socket.timeout, TimeoutError) as exc:
            raise LiveMetricsError(self.base_url, promql, f"timed out after {self.timeout_s:g} s") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise LiveMetricsError(self.base_url, promql, f"timed out after {self.timeout_s:g} s") from exc
            raise LiveMetricsError(self.base_url, promql, f"unreachable: {reason}") from exc
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise LiveMetricsError(self.base_url, promql, f"reply is not JSON: {body[:200]!r}") from exc
        return parse_value(payload, self.base_url, promql)

    def window_metrics(self, model: str, version: str, day: str) -> dict[str, float] | None:
        at = end_of_day_unix(day)
        out = {}
        for name, template in self.queries.items():
            value = self.query(render_query(template, model, version, day), at)
            if value is not None:
                out[name] = value
        return out or None


def from_policy(policy: GatePolicy, timeout_s: float = 10.0) -> PrometheusSource | None:
    """The configured source (`gate.live_metrics_url`, default queries), or None when live metrics are off."""
    return PrometheusSource(policy.live_metrics_url, timeout_s=timeout_s) if policy.live_metrics_url else None
