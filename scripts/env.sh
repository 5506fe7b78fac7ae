# Environment of the embedded default: SQLite for Airflow and MLflow, moto's S3 server on 127.0.0.1.
# Sourced by scripts/demo.sh and usable by hand:  source scripts/env.sh; airflow dags list
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DEMO_DIR="${DEMO_DIR:-$ROOT/.demo}"
export S3_PORT="${S3_PORT:-9753}"
export AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PORT" MLFLOW_S3_ENDPOINT_URL="http://127.0.0.1:$S3_PORT"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-demo}" AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-demo}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
export MLFLOW_TRACKING_URI="sqlite:///$DEMO_DIR/mlflow.db"
# Artifacts on local disk so `mlflow ui` can show them after the demo has stopped the S3 server.
export CTR_MLFLOW_ARTIFACT_ROOT="$DEMO_DIR/mlartifacts"
export MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
export MLFLOW_DISABLE_TELEMETRY=true   # no usage events from ad data; pipelines/__init__.py says why
export AIRFLOW_HOME="$DEMO_DIR/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags" AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__UNIT_TEST_MODE=False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$DEMO_DIR/airflow/airflow.db"
export AIRFLOW__LOGGING__LOGGING_LEVEL="${AIRFLOW__LOGGING__LOGGING_LEVEL:-INFO}"
export PYTHONPATH="$ROOT/plugins${PYTHONPATH:+:$PYTHONPATH}"
