"""`python -m pipelines.bench.serving [--quick]`: multi-adapter serving (`pipelines.serving`) timings.

Setup (built by the run itself, nothing outside a temporary directory): a SQLite MLflow store with a
local file artifact store; `ctr_base@champion` = an untrained CTRModel of the project's default
ModelConfig (pipelines.config); `ctr_lora_<slot>@champion` for the 3 synthetic slots plus a
`ctr_lora_feed@canary`, each a q_proj/v_proj r=8 adapter (LoraTrainConfig defaults) with random
non-zero LoRA weights; an AdapterServer on them with canary_share 0.1. One intra-op thread
(CTR_TORCH_THREADS, default 1). Every figure is a median, so another process on the machine shifts it
less than a mean.

Printed keys (one JSON object, exactly these):

* ``switch_ms``: time of `AdapterServer.apply(routes)` that swaps to versions already in memory:
  `ctr_lora_feed@champion` and `@canary` exchange versions, so the adapter set is unchanged and the
  stacked weights are reused. It builds the new routing table and replaces the reference; nothing is
  downloaded, unloaded or restacked. Not a canary promotion (that removes the canary: new adapter set,
  stacks rebuilt). Goal < 1 ms.
* ``refresh_ms``: one `AdapterServer.refresh()` right after a real `promote_canary` of
  `ctr_lora_feed` (`pipelines.promotion.aliases`: @canary becomes @champion, the canary alias is
  removed, both recorded): the alias lookups of every watched route, a new adapter set, the stacks
  rebuilt, the swap (the old champion stays in memory, idle, within max_loaded_adapters). The
  promoted version was already in memory as the canary, as in production. The versions carry
  `gate.passed=true` so the promotion's own checks pass (the benchmark has no gate). Goal < 120 ms.
* ``load_ms``: time of `apply(routes)` in which `ctr_lora_search@champion` names a version not in
  memory: resolve its `models:/` URI, download `artifacts/` from the local file store, verify the
  adapter file hashes against the registry tag and the base fingerprint, inject it into the shared
  PeftModel, swap, and evict the least recently routed idle version once past max_loaded_adapters.
  Goal < 200 ms.
  `load_ms` excludes `resolve()` (one registry query per watched alias, bound by the registry's latency;
  ~3 ms per alias on this SQLite store), which a periodic `refresh()` adds before `apply`.
* ``routed_vs_merged``: latency of `server.score(batch)` over that of the merged model on the same
  batch: median per-call seconds over many calls after warm-up, batch 32 rows drawn from one
  synthetic day (all 3 slots, traffic mix 60/30/10 %). The routed call is the full serving path
  (column check, encode, canary hash, routing, table lease, mixed-adapter forward, sigmoid, metrics);
  the merged model (`merge_and_unload` of the feed adapter, on a copy) runs encode + forward + sigmoid.
  Goal <= 1.20.
* ``merged_vs_base``: the merged model over the plain base, same batch and path. Goal <= 1.05 (the same
  architecture: a merged adapter is free at inference).

The same object carries the figures measured over HTTP against `python -m pipelines serve` with
concurrent clients (`rps_*`, `p50_ms_*`, `p99_ms_*`, `promote_visible_ms`, `promote_routes_ms`,
`promote_visible_ms_poll`, `p99_during_swaps_ratio`, `base_switch_ms`, `failed_requests`, `misrouted_requests`, and the
`requests_checked` / `moves` they count over); their definitions are in `pipelines.bench.serving_http`.
`--in-process-only` leaves them out.

Quick mode (about 2 minutes: creating the stores and logging the models is most of it) takes fewer samples.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import torch

from pipelines.bench import serving_demo as demo
from pipelines.bench import serving_http
from pipelines.bench.serving_procs import request_frame
from pipelines.config import ModelConfig
from pipelines.model import adapters
from pipelines.model.base import CTRModel
from pipelines.model.features import encode
from pipelines.model.inference import configure_threads
from pipelines.promotion.aliases import promote_canary
from pipelines.registry import mlflow_io
from pipelines.registry.mlflow_scope import temporary_mlflow
from pipelines.serving.loader import VersionRef
from pipelines.serving.router import AdapterServer

SLOTS = ("feed", "search", "splash")
BATCH = 32
CANARY_SHARE = 0.1
MODEL_SEED = 0


@contextlib.contextmanager
def _temporary_registry(root: Path) -> Iterator[str]:
    """Point MLflow (tracking and registry) at a new SQLite store under `root`; yields the id of an experiment
    whose artifacts go to root/mlruns. Afterwards the URIs and their variables are what they were, or every
    later MlflowClient of this process would keep using the deleted temporary store."""
    with temporary_mlflow(f"sqlite:///{root / 'mlflow.db'}"):
        yield mlflow.create_experiment("bench-serving", artifact_location=(root / "mlruns").as_uri())


def _populate(frame, extra_versions: int, experiment_id: str) -> dict:
    """Register base, slot champions, a feed canary and `extra_versions` more search versions."""
    torch.manual_seed(MODEL_SEED)
    base_model = CTRModel(ModelConfig()).eval()
    example = mlflow_io.input_example(frame)
    base = demo.register_base(base_model, example, experiment_id=experiment_id)
    logged, champions = {}, {}
    for i, slot in enumerate(SLOTS):
        logged[slot] = demo.log_adapter(
            demo.random_adapter(base_model, seed=10 + i), slot, base, example, experiment_id=experiment_id
        )
        champions[slot] = demo.register_adapter(logged[slot], f"ctr_lora_{slot}", slot, alias="champion", base=base)
    canary = demo.log_adapter(
        demo.random_adapter(base_model, seed=99), "feed", base, example, experiment_id=experiment_id
    )
    on_canary = demo.register_adapter(canary, "ctr_lora_feed", "feed", alias="canary", base=base)
    for v in (champions["feed"], on_canary):  # promote_canary releases only gated versions
        mlflow_io.client().set_model_version_tag("ctr_lora_feed", v, "gate.passed", "true")
    # Versions of the same logged files: each is a distinct version to download, verify and load.
    extra = [
        demo.register_adapter(logged["search"], "ctr_lora_search", "search", base=base) for _ in range(extra_versions)
    ]
    return {
        "base_model": base_model,
        "adapter_uri": f"models:/ctr_lora_feed/{champions['feed']}",
        "extra_search": extra,
    }


def _switch_ms(server, n: int) -> float:
    routes = server.resolve()
    a, b = routes[("ctr_lora_feed", "champion")], routes[("ctr_lora_feed", "canary")]
    flipped = {**routes, ("ctr_lora_feed", "champion"): b, ("ctr_lora_feed", "canary"): a}
    times = []
    for i in range(n):
        target = flipped if i % 2 == 0 else routes
        start = time.perf_counter()
        report = server.apply(target)
        times.append(time.perf_counter() - start)
        if not report["swapped"] or report["loaded"] or report["unloaded"]:
            raise RuntimeError(f"switch step {i} was not a pure swap: {report}")
    return 1000.0 * statistics.median(times)


def _refresh_ms(server, n: int) -> float:
    """Median ms of the refresh after each of `n` promote_canary moves; between them (untimed) the
    previous champion comes back as the canary and is loaded."""
    client, model = mlflow_io.client(), "ctr_lora_feed"
    pair = [client.get_model_version_by_alias(model, a).version for a in ("champion", "canary")]
    times = []
    for i in range(n):
        champion, canary = pair if i % 2 == 0 else pair[::-1]
        client.set_registered_model_alias(model, "canary", canary)
        server.refresh()
        promote_canary(model, reason="bench serving: refresh_ms")
        start = time.perf_counter()
        report = server.refresh()
        times.append(time.perf_counter() - start)
        routes = report["routes"]
        if routes.get(f"{model}@champion") != f"{model}:{canary}" or f"{model}@canary" in routes:
            raise RuntimeError(f"refresh {i} after promote_canary does not serve v{canary} alone: {report}")
    return 1000.0 * statistics.median(times)


def _load_ms(server, versions: list[str]) -> float:
    routes = server.resolve()
    times = []
    for v in versions:
        mv = server.registry.client.get_model_version("ctr_lora_search", v)
        target = {**routes, ("ctr_lora_search", "champion"): VersionRef("ctr_lora_search", v, dict(mv.tags), mv.run_id)}
        start = time.perf_counter()
        report = server.apply(target)
        times.append(time.perf_counter() - start)
        if report["loaded"] != [f"ctr_lora_search:{v}"] or report["refused"]:
            raise RuntimeError(f"loading ctr_lora_search v{v} did not load exactly it: {report}")
    return 1000.0 * statistics.median(times)


def _merged_model(base_model, adapter_uri: str):
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(mlflow_io.download_artifacts(artifact_uri=f"{adapter_uri}/artifacts/adapter", dst_path=tmp))
        return adapters.load(copy.deepcopy(base_model), str(local)).merge_and_unload().eval()


def _plain_scorer(model) -> Callable:
    def score(frame):
        with torch.inference_mode():
            return torch.sigmoid(model(torch.from_numpy(encode(frame, model.cfg)))).numpy()

    return score


def _latencies(scorers: dict[str, Callable], batch, calls: int) -> dict[str, float]:
    """Median seconds per call of each scorer; calls alternate between the scorers, so a load spike
    from another process hits all of them alike."""
    for fn in scorers.values():  # warm-up
        for _ in range(max(20, calls // 10)):
            fn(batch)
    samples: dict[str, list[float]] = {k: [] for k in scorers}
    for _ in range(calls):
        for name, fn in scorers.items():
            start = time.perf_counter()
            fn(batch)
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(quick: bool, http: bool = True) -> dict:
    """Build the temporary registry, measure, return {switch_ms, refresh_ms, load_ms, routed_vs_merged,
    merged_vs_base} and, with `http`, the figures of `pipelines.bench.serving_http`."""
    configure_threads()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    n_switch, n_refresh, n_load, calls = (40, 5, 5, 600) if quick else (400, 20, 20, 3000)
    frame = request_frame(2000)
    batch = frame.sample(BATCH, random_state=1).reset_index(drop=True)
    with tempfile.TemporaryDirectory() as tmp, _temporary_registry(Path(tmp)) as experiment_id:
        built = _populate(frame, n_load, experiment_id)
        server = AdapterServer(SLOTS, canary_share=CANARY_SHARE)
        switch = _switch_ms(server, n_switch)
        refresh = _refresh_ms(server, n_refresh)
        load = _load_ms(server, built["extra_search"])
        merged = _merged_model(built["base_model"], built["adapter_uri"])
    lat = _latencies(
        {"routed": server.score, "merged": _plain_scorer(merged), "base": _plain_scorer(built["base_model"])},
        batch,
        calls,
    )
    out = {
        "switch_ms": switch,
        "refresh_ms": refresh,
        "load_ms": load,
        "routed_vs_merged": lat["routed"] / lat["merged"],
        "merged_vs_base": lat["merged"] / lat["base"],
    }
    if http:
        out.update(serving_http.run(quick))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="fewer samples (about 2 minutes)")
    p.add_argument("--in-process-only", action="store_true", help="leave out the HTTP figures")
    a = p.parse_args(argv)
    print(json.dumps(run(quick=a.quick, http=not a.in_process_only)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
