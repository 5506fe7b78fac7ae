"""Prometheus metrics of one AdapterServer, on its own CollectorRegistry (two servers never collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Batch latencies of a small CTR model sit between ~0.2 ms and tens of ms.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.active_adapters = Gauge("ctr_serving_active_adapters",
                                     "Adapter versions the current routing table sends traffic to", registry=r)
        self.loaded_adapters = Gauge("ctr_serving_loaded_adapters",
                                     "Adapter versions in memory (active + draining in-flight requests)", registry=r)
        self.inference_seconds = Histogram(
            "ctr_serving_inference_seconds",
            "Forward-pass latency of a request batch, observed once per <model>:<version> the batch used",
            ["adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.swaps = Counter("ctr_serving_swaps", "Routing tables installed with a changed route", registry=r)
        self.refused_loads = Counter("ctr_serving_refused_loads", "Adapter versions refused at load, by reason",
                                     ["reason"], registry=r)
        self.adapter_loads = Counter("ctr_serving_adapter_loads", "Adapter versions loaded into memory", registry=r)
        self.adapter_unloads = Counter("ctr_serving_adapter_unloads", "Adapter versions deleted from memory",
                                       registry=r)

    def render(self) -> str:
        """The Prometheus text exposition of every metric above."""
        return generate_latest(self.registry).decode()
