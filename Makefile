# The two commands a new user needs are `make demo` and `make test` (see README.md).
.PHONY: install demo lint test test-fast bench compose-check clean stack stack-down bench-stack

install:
	scripts/install.sh

# Embedded default end to end: moto S3, SQLite for Airflow + MLflow, real `airflow dags test` runs.
demo: install
	scripts/demo.sh

# ruff (lint + format check, pyproject.toml [tool.ruff]), then the import contracts of pipelines/ (layers; no
# Airflow in pipelines; DAGs and operators call only entry functions and flows): pyproject.toml
# [tool.importlinter], docs/architecture.md "Layers".
lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	PYTHONPATH=plugins .venv/bin/lint-imports

# Every test, slow ones included (end-to-end DAG runs on PostgreSQL when reachable, else SQLite; the
# local stack through its REST API). Two xdist workers, one test file each at a time: module-scoped
# stacks are built once, and every test isolates its stores, buckets, ports and databases.
PYTEST_WORKERS ?= 2
test: install lint
	.venv/bin/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile --durations=30

test-fast: install
	.venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow"

# Measurements written to docs/benchmarks.md (machine and command included).
bench: install
	.venv/bin/python -m pipelines.bench --write docs/benchmarks.md

# The compose file with a throwaway generated env file (the real one, .env, holds this machine's secrets).
compose-check:
	@tmp=$$(mktemp -d) && python3 scripts/compose_env.py --env-file $$tmp/env >/dev/null && \
	docker compose --env-file $$tmp/env -f docker-compose.yml config -q && \
	docker compose --env-file $$tmp/env -f docker-compose.yml --profile debug config -q; \
	rc=$$?; rm -rf $$tmp; exit $$rc

clean:
	rm -rf .demo .bench

# The production topology on one machine (no Docker): moto S3, mlflow server on PostgreSQL, Airflow
# api-server + scheduler + dag-processor + triggerer, CeleryExecutor (Redis) with two workers.
stack: install
	.venv/bin/python scripts/stack.py up

stack-down:
	.venv/bin/python scripts/stack.py down

# Stack start-up, a retrain DAG run under Celery (with and without the worker preload) and under
# `airflow dags test`: the "Local stack" section of docs/benchmarks.md.
bench-stack: install
	.venv/bin/python scripts/bench_stack.py --write docs/benchmarks.md
