# MLflow tracking server + model registry. The upstream mlflow image ships neither the Postgres
# driver nor boto3, so build a small one, pinned to the versions the pipelines were tested with.
# The `auth` extra (Flask-WTF) is what `mlflow server --app-name basic-auth` needs (docker-compose.yml).
FROM python:3.11-slim-bookworm

COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir -c /tmp/constraints.txt "mlflow[auth]==3.17.2" Flask-WTF==1.3.0 psycopg2-binary boto3 \
 && rm /tmp/constraints.txt \
 && useradd --create-home --uid 1000 mlflow

# No usage telemetry from a server that holds ad-model lineage (pipelines/__init__.py says why).
ENV MLFLOW_DISABLE_TELEMETRY=true
USER mlflow
WORKDIR /home/mlflow
EXPOSE 5000
