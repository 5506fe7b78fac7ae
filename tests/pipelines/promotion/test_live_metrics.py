"""PrometheusSource against a real HTTP server on 127.0.0.1 that answers like the Prometheus HTTP API
(canned JSON per query), including error statuses, malformed replies, a dead port and a timeout."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipelines.config import GatePolicy
from pipelines.errors import ConfigError, PipelineError
from pipelines.promotion.live_metrics import (
    LiveMetricsError,
    PrometheusSource,
    end_of_day_unix,
    from_policy,
    render_query,
)
from tests.conftest import free_port


def vector(*values: str) -> dict:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"model": "m"}, "value": [1704585600.0, v]} for v in values],
        },
    }


class Prometheus(BaseHTTPRequestHandler):
    """GET /api/v1/query: the reply for the query is looked up in `server.replies` (status, body)."""

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        args = urllib.parse.parse_qs(url.query)
        self.server.seen.append(
            {"path": url.path, "query": args.get("query", [""])[0], "time": args.get("time", [""])[0]}
        )
        query = args.get("query", [""])[0]
        status, body = self.server.replies.get(
            query, (400, {"status": "error", "errorType": "bad_data", "error": f"unknown query {query}"})
        )
        if body == "sleep":
            time.sleep(1.0)
            status, body = 200, vector("1")
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def prom():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Prometheus)
    server.replies, server.seen = {}, []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


QUERIES = {
    "live_ctr": 'sum(rate(clicks{model="{model}",version="{version}"}[1d]))',
    "live_impressions": 'sum(impressions{model="{model}",version="{version}",day="{day}"})',
}


def rendered(name: str) -> str:
    return render_query(QUERIES[name], "ctr_lora_feed", "3", "2024-01-06")


def test_window_metrics_query_each_metric_at_the_end_of_the_day(prom):
    prom.replies = {rendered("live_ctr"): (200, vector("0.042")), rendered("live_impressions"): (200, vector("1200"))}
    src = PrometheusSource(url(prom) + "/", QUERIES, timeout_s=5)
    assert src.window_metrics("ctr_lora_feed", "3", "2024-01-06") == {"live_ctr": 0.042, "live_impressions": 1200.0}
    assert [s["path"] for s in prom.seen] == ["/api/v1/query"] * 2
    # PromQL's label braces survive the templating; the placeholders do not
    assert prom.seen[0]["query"] == 'sum(rate(clicks{model="ctr_lora_feed",version="3"}[1d]))'
    assert 'day="2024-01-06"' in prom.seen[1]["query"]
    end = dt.datetime(2024, 1, 7, tzinfo=dt.timezone.utc).timestamp()
    assert float(prom.seen[0]["time"]) == end == end_of_day_unix("2024-01-06")


def test_empty_or_nan_results_are_no_value_not_an_error(prom):
    prom.replies = {rendered("live_ctr"): (200, vector()), rendered("live_impressions"): (200, vector("NaN"))}
    assert PrometheusSource(url(prom), QUERIES).window_metrics("ctr_lora_feed", "3", "2024-01-06") is None
    prom.replies[rendered("live_impressions")] = (
        200,
        {"status": "success", "data": {"resultType": "scalar", "result": [1.0, "7"]}},
    )
    assert PrometheusSource(url(prom), QUERIES).window_metrics("ctr_lora_feed", "3", "2024-01-06") == {
        "live_impressions": 7.0
    }


@pytest.mark.parametrize(
    "status, body, message",
    [
        (
            400,
            {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"},
            "HTTP 400: bad_data: parse error",
        ),
        (503, b"<html>down for maintenance</html>", "HTTP 503: <html>down for maintenance"),
        (
            200,
            {"status": "error", "errorType": "timeout", "error": "query timed out"},
            "status 'error': timeout query timed out",
        ),
        (200, b"not json at all", "reply is not JSON"),
        (200, vector("0.1", "0.2"), "2 series returned, expected one"),
        (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}, "unsupported resultType 'matrix'"),
        (
            200,
            {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1.0]}]}},
            "malformed sample",
        ),
    ],
)
def test_failures_raise_a_typed_error_naming_url_and_query(prom, status, body, message):
    prom.replies = {rendered("live_ctr"): (status, body)}
    src = PrometheusSource(url(prom), {"live_ctr": QUERIES["live_ctr"]})
    with pytest.raises(LiveMetricsError) as err:
        src.window_metrics("ctr_lora_feed", "3", "2024-01-06")
    assert isinstance(err.value, PipelineError)
    assert message in str(err.value) and url(prom) in str(err.value)
    assert 'clicks{model="ctr_lora_feed",version="3"}' in str(err.value)


def test_a_slow_server_times_out(prom):
    prom.replies = {rendered("live_ctr"): (200, "sleep")}
    t = time.perf_counter()
    with pytest.raises(LiveMetricsError, match=r"timed out after 0\.3 s"):
        PrometheusSource(url(prom), {"live_ctr": QUERIES["live_ctr"]}, timeout_s=0.3).window_metrics(
            "ctr_lora_feed", "3", "2024-01-06"
        )
    assert time.perf_counter() - t < 0.9


def test_nothing_listening_is_unreachable():
    src = PrometheusSource(f"http://127.0.0.1:{free_port()}", {"x": "up"}, timeout_s=2)
    with pytest.raises(LiveMetricsError, match="unreachable"):
        src.window_metrics("m", "1", "2024-01-06")


def test_bad_settings_are_refused_and_the_policy_picks_the_source():
    with pytest.raises(ConfigError, match="must start with http"):
        PrometheusSource("prometheus:9090")
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        PrometheusSource("http://127.0.0.1:9090", timeout_s=0)
    assert from_policy(GatePolicy()) is None
    src = from_policy(GatePolicy(live_metrics_url="http://prometheus:9090"))
    assert isinstance(src, PrometheusSource) and "live_ctr" in src.queries and src.base_url == "http://prometheus:9090"
