"""Prometheus metrics of one AdapterServer, on its own CollectorRegistry (two servers never collide).

Names start with `lora_`; the HTTP front (`serving.http`) and its follower (`serving.follow`) add theirs
to the same registry, so `GET /metrics` is one exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Batch latencies of a small CTR model sit between ~0.2 ms and tens of ms.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.active_adapters = Gauge(
            "lora_active_adapters", "Adapter versions the current routing table sends traffic to", registry=r
        )
        self.loaded_adapters = Gauge(
            "lora_loaded_adapters",
            "Adapter versions in memory (routed, draining, idle within the cap, or on a pending base)",
            registry=r,
        )
        self.inference_seconds = Histogram(
            "lora_inference_seconds",
            "Forward-pass latency of a request batch, observed once per <model>:<version> the batch used",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.swaps = Counter("lora_swaps", "Routing tables installed with a changed route", registry=r)
        self.refused_loads = Counter(
            "lora_refused_loads", "Adapter versions refused at load, by reason", ["reason"], registry=r
        )
        self.adapter_loads = Counter("lora_adapter_loads", "Adapter versions loaded into memory", registry=r)
        self.adapter_unloads = Counter("lora_adapter_unloads", "Adapter versions deleted from memory", registry=r)
        self.slow_loads = Counter(
            "lora_slow_loads",
            "Moves that missed a refresh's load budget: their previous version served on "
            "until loaded, then a second swap",
            registry=r,
        )
        self.cap_exceeded = Gauge(
            "lora_loaded_cap_exceeded",
            "1 when routed and draining versions alone hold more than max_loaded_adapters",
            registry=r,
        )
        # base changes (router: a new ctr_base@champion waits for its adapters, then all slots switch at once)
        self.base_info = Gauge(
            "lora_base", "1 per base version in memory, by state (serving / pending)", ["version", "state"], registry=r
        )
        self.base_pending = Gauge(
            "lora_base_pending", "1 while a new base@champion waits for adapter champions trained on it", registry=r
        )
        self.base_switches = Counter(
            "lora_base_switches", "Switches of every slot to a new base, in one swap", registry=r
        )

        # the follower: how fresh the routes are
        self.refreshes = Counter(
            "lora_refreshes",
            "Registry refreshes, by trigger and outcome (ok / error)",
            ["trigger", "outcome"],
            registry=r,
        )
        self.last_refresh = Gauge(
            "lora_last_refresh_timestamp_seconds", "Unix time of the last refresh that read the registry", registry=r
        )
        # the HTTP front
        self.requests = Counter("lora_requests", "Scoring requests answered, by HTTP status", ["status"], registry=r)
        self.rows_scored = Counter(
            "lora_rows_scored", "Rows scored, by the <model>:<version> that scored them", ["version"], registry=r
        )

    def render(self) -> str:
        """The Prometheus text exposition of every metric above."""
        return generate_latest(self.registry).decode()
