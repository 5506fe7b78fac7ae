"""The MLflow pyfunc that serves pCTR from contract rows: the base model, or base + one LoRA adapter.

An adapter version does not copy the base weights: it names the base version it was trained on
(`meta.base`) and loads it from the registry, then checks the base's weight fingerprint against the
one recorded at training time; the adapter's files must hash to what was recorded when it was logged
(`registry.integrity`). Either mismatch refuses to load rather than serve a wrong model.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd

from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import RegistryError


def load_base_from_registry(name: str, version: str, expected_fingerprint: str | None = None):
    """Download `models:/<name>/<version>` and return the frozen CTRModel, verifying its fingerprint."""
    import mlflow.artifacts

    from pipelines.model import store
    from pipelines.model.base import fingerprint

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}"))
    model = store.load_base(local / "artifacts" / "base")
    if expected_fingerprint is not None:
        actual = fingerprint(model)
        if actual != expected_fingerprint:
            raise RegistryError(f"base {name} v{version} has fingerprint {actual[:12]}..., "
                                f"but this adapter was trained on {expected_fingerprint[:12]}...; refusing to load")
    return model


class CTRPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from pipelines.model import store
        from pipelines.model import adapters

        self.meta = json.loads(Path(context.artifacts["meta"]).read_text())
        if self.meta["kind"] == "base":
            self.model = store.load_base(context.artifacts["base"])
        else:
            from pipelines.registry.integrity import verify_files

            b = self.meta["base"]
            verify_files(context.artifacts["adapter"], self.meta.get("adapter_files"),
                         f"adapter of slot {self.meta.get('slot')!r} (base {b['name']} v{b['version']})")
            base = load_base_from_registry(b["name"], b["version"], b["fingerprint"])
            self.model = adapters.load(base, context.artifacts["adapter"])
        self._cfg = self.model.cfg if hasattr(self.model, "cfg") else self.model.get_base_model().cfg

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        from pipelines.model.features import encode
        from pipelines.model.inference import predict

        missing = [c for c in FEATURE_FIELDS if c not in model_input.columns]
        if missing:
            raise RegistryError(f"input is missing feature columns {missing}")
        return predict(self.model, encode(model_input, self._cfg))
