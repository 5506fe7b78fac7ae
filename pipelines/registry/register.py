"""Stage: register an evaluated adapter as a new version of `ctr_lora_<slot>` with full lineage tags.

The version gets alias `candidate`; `@champion` is only ever moved by the gate or an operator.
"""
from __future__ import annotations

import json

from pipelines.config import PipelineConfig


def lineage_tags(candidate: dict, evaluation: dict) -> dict:
    from pipelines.registry import mlflow_io

    d, b = candidate["data"], candidate["base"]
    return {
        "slot": candidate["slot"],
        "data.first": d["first"], "data.last": d["last"], "data.partitions": d["count"], "data.sha256": d["sha256"],
        "config.hash": candidate["config_hash"], "code.version": mlflow_io.code_version(),
        "base.name": b["name"], "base.version": b["version"], "base.fingerprint": b["fingerprint"],
        "training.run_id": candidate["run_id"],
        "eval.candidate": json.dumps(evaluation["candidate"], sort_keys=True),
        "eval.champion": json.dumps(evaluation["champion"], sort_keys=True),
        "eval.champion_version": evaluation["champion_version"] or "",
        "gate.passed": "pending",
    }


def register(cfg: PipelineConfig, candidate: dict, evaluation: dict) -> dict:
    from pipelines.registry import mlflow_io

    name = candidate["model_name"]
    version = mlflow_io.register(candidate["model_uri"], name, lineage_tags(candidate, evaluation),
                                 alias="candidate", run_id=candidate["run_id"])
    return {"model": name, "version": version, "slot": candidate["slot"], "evaluation": evaluation}
