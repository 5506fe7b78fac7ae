#!/usr/bin/env bash
# The embedded default, end to end, in one command (no Docker):
#   venv + install -> S3 server (moto) on 127.0.0.1 -> MovieLens-100K into the lake as daily partitions
#   -> real Airflow DAG runs (`airflow dags test`, SQLite): base model, then four daily retrains (each
#   judges yesterday's candidates on the day's rows, trains the day's one on its whole window and
#   releases what the judgement let go), revert a champion from the ops DAG -> summary.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
scripts/install.sh
source .venv/bin/activate
source scripts/env.sh
rm -rf "$DEMO_DIR" && mkdir -p "$DEMO_DIR/airflow" "$DEMO_DIR/logs"

step() { printf '\n== %s (%ss)\n' "$1" "$(( $(date +%s) - t0 ))"; }
run_dag() {  # run_dag <log name> <airflow dags test args...>: full log to a file, its tail on failure
  local log="$DEMO_DIR/logs/$1.log"; shift
  if ! airflow dags test "$@" >"$log" 2>&1; then
    tail -n 60 "$log"; echo "!! airflow dags test $* failed; full log: $log"; exit 1
  fi
  grep -hE "gate (PASSED|REJECTED)|  FAIL  |@(champion|canary): |holdout rows \(|judged on [0-9-]+: |waits after|validated [0-9]+ partitions" "$log" \
    | sed -E 's/^[0-9TZ:.-]+ \[[a-z ]+\] //; s/ \[[a-z_.]+\] loc=.*$//' | sed 's/^/   /' || true
}

step "S3-compatible server (moto) on 127.0.0.1:$S3_PORT"
moto_server -H 127.0.0.1 -p "$S3_PORT" >"$DEMO_DIR/logs/moto.log" 2>&1 &
MOTO_PID=$!
trap 'kill $MOTO_PID 2>/dev/null || true' EXIT
python - <<'PY'
import time, boto3, botocore
s3 = boto3.client("s3")
for _ in range(100):
    try:
        s3.create_bucket(Bucket="ctr-lake"); break
    except botocore.exceptions.EndpointConnectionError:
        time.sleep(0.1)
else:
    raise SystemExit("moto server did not start")
PY

step "MovieLens-100K -> s3://ctr-lake/clicks/dt=YYYY-MM-DD (read from the installed recbole wheel)"
python -m pipelines generate --source movielens --out s3://ctr-lake/clicks

step "Airflow metadata DB (SQLite)"
airflow db migrate >"$DEMO_DIR/logs/db-migrate.log" 2>&1
airflow pools set ctr_registry 1 "registry writes: registration and alias moves" >>"$DEMO_DIR/logs/db-migrate.log" 2>&1

step "DAG ctr_base_model for 1997-12-31: validate, train the base on 1997-09..12, gate it, release ctr_base@champion"
run_dag base ctr_base_model 1997-12-31
step "DAG ctr_lora_retrain for 1998-03-01: the first candidates train on their whole window and wait"
run_dag retrain-1998-03-01 ctr_lora_retrain 1998-03-01
step "DAG ctr_lora_retrain for 1998-03-02: yesterday's candidates judged on today's rows (no champion yet: first-run checks); today's go out in their place"
run_dag retrain-1998-03-02 ctr_lora_retrain 1998-03-02
for day in 1998-03-03 1998-03-04; do
  step "DAG ctr_lora_retrain for $day: the serving champions judged (beside the one they replaced: sequential test); a pass releases today's candidate"
  run_dag "retrain-$day" ctr_lora_retrain "$day"
done

MODEL=$(python - <<'PY'
from pipelines.config import load_pipeline_config
from pipelines.promotion import aliases
cfg = load_pipeline_config()
moved = [cfg.adapter_model_name(s) for s in cfg.data.slots if len(aliases.history(cfg.adapter_model_name(s))) >= 2]
print(moved[0] if moved else "")
PY
)
if [ -n "$MODEL" ]; then
  step "DAG ctr_model_ops: revert $MODEL to the previous champion (one step)"
  run_dag revert ctr_model_ops -c "{\"action\": \"revert\", \"model\": \"$MODEL\", \"reason\": \"demo: put the previous champion back\"}"
else
  echo "   no slot released twice: no previous champion to revert to"
fi

step "Summary"
grep -h "validated [0-9]* partitions" "$DEMO_DIR"/logs/*.log | sed -E 's/^.*\] (validated)/validation: \1/; s/ \[pipelines.*$//'
python -m pipelines status
cat <<MSG

Done in $(( $(date +%s) - t0 ))s. Logs: $DEMO_DIR/logs/
Champion history of one model:   source scripts/env.sh && .venv/bin/python -m pipelines history --model ${MODEL:-ctr_lora_morning}
MLflow UI on the produced store: source scripts/env.sh && .venv/bin/mlflow ui --backend-store-uri "\$MLFLOW_TRACKING_URI" --port 5000
MSG
