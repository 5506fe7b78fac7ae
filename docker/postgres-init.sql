-- Runs once, on an empty data volume only (postgres' /docker-entrypoint-initdb.d). The airflow
-- database comes from POSTGRES_DB; MLflow's tracking + registry tables get their own database so
-- `airflow db reset` and `mlflow db upgrade` never touch each other's schema.
CREATE DATABASE mlflow;
-- MLflow's basic-auth app keeps its users and permissions apart from the tracking data.
CREATE DATABASE mlflow_auth;
