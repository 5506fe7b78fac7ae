"""The CTR adapter lifecycle as plain Python: stages, flows and the CLI (`python -m pipelines`)."""

import os

# MLflow 3's usage telemetry is on by default: it would send usage events from machines that hold ad data,
# and its background thread sets and unsets `_MLFLOW_TELEMETRY_SESSION_ID` in os.environ, so any thread
# iterating the environment meanwhile raises KeyError (a task's first try failed so in MLflow's log-batch).
# Off in every process that imports this package, unless a user set it explicitly; scripts/stack.py,
# scripts/env.sh, docker-compose.yml and the images set it too, for processes that import MLflow first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
