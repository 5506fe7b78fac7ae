# The two commands a new user needs are `make demo` and `make test` (see README.md).
.PHONY: install demo test test-fast bench compose-check clean

install:
	scripts/install.sh

# Embedded default end to end: moto S3, SQLite for Airflow + MLflow, real `airflow dags test` runs.
demo: install
	scripts/demo.sh

# Every test, slow ones included (end-to-end DAG runs on PostgreSQL when reachable, else SQLite).
test: install
	.venv/bin/python -m pytest -q -p no:cacheprovider

test-fast: install
	.venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow"

# Measurements written to docs/benchmarks.md (machine and command included).
bench: install
	.venv/bin/python -m pipelines.bench --write docs/benchmarks.md

compose-check:
	docker compose -f docker-compose.yml config -q && docker compose -f docker-compose.yml --profile celery config -q

clean:
	rm -rf .demo .bench
