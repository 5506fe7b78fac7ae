"""Airflow extra links to what a task wrote in MLflow: its run and the model version it registered or moved.

Airflow 3 computes an operator's extra links in the worker when the task ends (`get_link` is called with the
operator that ran) and keeps each as an XCom the UI reads, so a link needs nothing from the API server. A task
states what it wrote by returning it (a `run_id`, a `model` and `version`, possibly inside a candidate dict);
`remember` reads that off the result. The MLflow UI is the tracking server when it is one (`http(s)://`), else
`CTR_MLFLOW_UI_URL`; with neither there is no UI to link to and the links stay empty.
"""

from __future__ import annotations

import os
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

UI_ENV = "CTR_MLFLOW_UI_URL"
_ATTR = "ctr_mlflow_links"


def mlflow_ui(environ=os.environ) -> str | None:
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    base = uri if uri.startswith(("http://", "https://")) else environ.get(UI_ENV, "")
    return base.rstrip("/") or None


def find(value, key: str, depth: int = 0):
    """The first non-empty string under `key` in nested dicts: this level's first, then each value's (3 levels)."""
    if not isinstance(value, dict) or depth > 3:
        return None
    if isinstance(value.get(key), str) and value[key]:
        return value[key]
    return next((f for v in value.values() if (f := find(v, key, depth + 1))), None)


def urls(result, environ=os.environ) -> dict[str, str]:
    """{"run": URL of the MLflow run, "version": URL of the model version} that `result` names (either may be
    absent)."""
    base = mlflow_ui(environ)
    if base is None or not isinstance(result, dict):
        return {}
    out = {}
    if run_id := find(result, "run_id"):
        out["run"] = f"{base}/#/runs/{quote(str(run_id), safe='')}"
    model, version = result.get("model") or find(result, "model_name"), result.get("version")
    if isinstance(model, str) and model and isinstance(version, (str, int)) and str(version):
        out["version"] = f"{base}/#/models/{quote(str(model), safe='')}/versions/{quote(str(version), safe='')}"
    return out


def remember(operator, result) -> None:
    """Keep the links of `result` on `operator` until Airflow asks for them when the task ends."""
    setattr(operator, _ATTR, urls(result))


def remembered(operator) -> dict[str, str]:
    return getattr(operator, _ATTR, {})


class _Link(BaseOperatorLink):
    kind = ""

    def get_link(self, operator, *, ti_key) -> str:
        return remembered(operator).get(self.kind, "")


class MlflowRunLink(_Link):
    name = "MLflow run"
    kind = "run"


class MlflowModelVersionLink(_Link):
    name = "MLflow model version"
    kind = "version"


LINKS = (MlflowRunLink(), MlflowModelVersionLink())
