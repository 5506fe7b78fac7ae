"""The deployment users run, end to end: `scripts/stack.py up` (what `make stack` runs) starts moto's
S3, an `mlflow server` on PostgreSQL with proxied artifacts, and Airflow's api-server, scheduler,
dag-processor, triggerer and two Celery workers. Everything below goes through Airflow's REST API v2
(JWT) as the UI would, and every result is read back through the tracking server over HTTP.

Flow, in the shipped prequential order (`lora.judged_on: next_day`, `judge_release: successor`): base model ->
unpausing (the arrival DAG's run for today waits, nothing fails) -> retrain day 1 (candidates trained on their
whole window, waiting to be judged) -> days 2 and 3 arrive: `ctr_lake_arrival` validates each and its Asset event
starts retrain, cold start and the monitor by itself; each retrain judges yesterday's candidates on the day's
rows and releases the day's candidates in their place (day 2: the first champions; day 3: canaries beside them);
every release is approved through the HITL REST endpoint -> model ops (promote a canary, revert, override, an
invalid form) -> a person in a browser retrains day 4, approves its releases and follows the links to the registry.
Checked:
versions, aliases, alias history, gate records, Asset events, clean task logs, and that the mapped
tasks ran on both Celery workers.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest
from mlflow import MlflowClient

from pipelines.evaluation.timeline import day_step, run_of
from pipelines.promotion import aliases
from pipelines.promotion.aliases import history
from tests.e2e.airflow_rest import AirflowREST
from tests.e2e.browser import AirflowUI, browser, model_page_description
from tests.e2e.live_stack import DAILY, LAKE_LAST_DAY, alias_of, approve_all, live, versions, worker_prefix  # noqa: F401 (live: the fixture)

pytestmark = pytest.mark.slow

CUTOFF, DAY1, DAY2, DAY3, DAY4 = "1997-12-31", "1998-03-01", "1998-03-02", "1998-03-03", LAKE_LAST_DAY
VALIDATED_URI = "x-ctr-lake://clicks/validated"
SLOTS = ("morning", "afternoon", "night")
WORKERS = ("worker-1", "worker-2")


def test_stack_is_up_and_a_second_up_is_idempotent(live):
    assert "stack healthy in" in live.up_output and "Airflow UI" in live.up_output
    again = live.cli("up")
    assert again.returncode == 0, again.stderr
    for comp in ("s3", "mlflow", "api-server", "scheduler", "dag-processor", "triggerer", *WORKERS, "serve"):
        assert f"{comp}: already running" in again.stdout
    assert f"http://127.0.0.1:{live.env['STACK_SERVE_PORT']}/invocations" in live.up_output
    assert live.cli("status").returncode == 0


def test_base_model_through_the_rest_api(live):
    rest = live.rest()
    rest.trigger("ctr_base_model", "base", CUTOFF)
    for dag_id in ("ctr_base_model", "ctr_model_ops", "ctr_lake_arrival", *DAILY):
        rest.unpause(dag_id)
    answered: list = []
    # A base is a release: gated against the (absent) serving base, then approved like any release.
    run = rest.wait("ctr_base_model", "base", on_poll=approve_all(rest, "ctr_base_model", "base", answered))
    assert run["state"] == "success" and answered == [(-1, "Approve")]
    assert alias_of("ctr_base") == "1"
    tags = versions("ctr_base")[0].tags
    assert len(tags["fingerprint"]) == 64 and tags["gate.passed"] == "true"

    move = aliases.history("ctr_base")[-1]
    assert move["reason"].startswith("base passed gate (first base) (approved by ")
    assert move["reason"].endswith("adapters this base makes incompatible (retrain them): none")


def test_unpausing_waits_for_data_instead_of_failing(live):
    """Unpaused, the arrival DAG starts a run for today at once: its sensor waits (reschedule mode)
    for a partition the lake does not have; the data-aware DAGs start nothing by themselves."""
    rest = live.rest()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        runs = rest.runs("ctr_lake_arrival", run_type="scheduled")
        tis = rest.task_instances("ctr_lake_arrival", runs[0]["dag_run_id"]) if runs else []
        if any(t["task_id"] == "wait_for_partition" and t["state"] == "up_for_reschedule" for t in tis):
            break
        time.sleep(3)
    else:
        raise AssertionError(f"today's arrival run never waited: {runs} {tis}")
    assert rest.run("ctr_lake_arrival", runs[0]["dag_run_id"])["state"] == "running"
    for dag_id in DAILY:
        assert rest.runs(dag_id) == [], f"{dag_id} started without a validated partition"


def check_retrain(rest: AirflowREST, run_id: str, day: str, released: str | None) -> None:
    """Versions, judgements, gate records, approvals and aliases of one retrain run; its logs; one adapter per
    slot. The day's candidate trained through `day`: waiting (day 1, nothing to judge yet), or released in its
    judged predecessor's place to the alias `released` once a person approved it."""
    for slot in SLOTS:
        name = f"ctr_lora_{slot}"
        latest = versions(name)[-1]
        assert latest.tags["data.last"] == day and latest.tags["judge.trained_through"] == day
        if released is None:
            assert latest.tags["judge.state"] == "waiting" and latest.tags["gate.passed"] == "pending"
            assert alias_of(name) is None
            continue
        assert latest.tags["judge.successor_of"] == str(int(latest.version) - 1)
        gate = json.loads(latest.tags["gate.checks"])
        assert gate and all({"name", "passed"} <= set(c) for c in gate)
        assert latest.tags["gate.passed"] == "true", gate
        assert "Approve" in latest.tags["release.approval"]
        assert alias_of(name, released) == latest.version
    # clean task logs: no per-batch MLflow signature warnings, nothing shown as an error
    log = rest.task_log("ctr_lora_retrain", run_id, "evaluate", map_index=0)
    assert "Found extra inputs" not in log
    assert not [line for line in log.splitlines() if line.startswith("[error]")], log[-3000:]
    tis = rest.task_instances("ctr_lora_retrain", run_id)
    assert len([t for t in tis if t["task_id"] == "train_adapter"]) == len(SLOTS)
    assert len([t for t in tis if t["task_id"] == "judge"]) == len(SLOTS)
    # named, not numbered: each mapped instance shows its slot
    assert sorted(t["rendered_map_index"] for t in tis if t["task_id"] == "train_adapter") == sorted(SLOTS)
    # no retry hid a failure: every task instance ran once at most
    assert [(t["task_id"], t["map_index"]) for t in tis if t["try_number"] > 1] == []
    for slot in SLOTS:  # the version and its training run name the task instances that wrote them
        latest = versions(f"ctr_lora_{slot}")[-1]
        assert (latest.tags["airflow.dag_id"], latest.tags["airflow.run_id"], latest.tags["airflow.task_id"]) == (
            "ctr_lora_retrain",
            run_id,
            "register",
        )
        trained = MlflowClient().get_run(latest.run_id).data.tags
        assert (trained["airflow.run_id"], trained["airflow.task_id"], trained["airflow.try_number"]) == (
            run_id,
            "train_adapter",
            "1",
        )
        assert trained["airflow.url"].startswith(f"{rest.base_url}/dags/ctr_lora_retrain/runs/")
        assert trained["airflow.worker"].startswith(worker_prefix())  # the Celery node, by name
    check_links_both_ways(rest, run_id, tis)


def check_links_both_ways(rest: AirflowREST, run_id: str, tis: list[dict]) -> None:
    """Airflow -> MLflow: each train_adapter instance links to its MLflow run, each register instance to its
    version; MLflow -> Airflow: the run's `airflow.url` is that very mapped instance's page. The task log names
    the Celery worker that ran it."""
    mlflow_ui = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    for ti in (t for t in tis if t["task_id"] == "register"):
        slot = ti["rendered_map_index"]
        link = rest.extra_links("ctr_lora_retrain", run_id, "register", ti["map_index"])["MLflow model version"]
        version = next(v for v in versions(f"ctr_lora_{slot}") if v.tags.get("airflow.run_id") == run_id)
        assert link == f"{mlflow_ui}/#/models/ctr_lora_{slot}/versions/{version.version}", link
        train = next(t for t in tis if t["task_id"] == "train_adapter" and t["rendered_map_index"] == slot)
        run_link = rest.extra_links("ctr_lora_retrain", run_id, "train_adapter", train["map_index"])["MLflow run"]
        assert run_link == f"{mlflow_ui}/#/runs/{version.run_id}", run_link
        url = MlflowClient().get_run(version.run_id).data.tags["airflow.url"]
        assert url.endswith(f"/tasks/train_adapter/mapped/{train['map_index']}"), url
    log = rest.task_log("ctr_lora_retrain", run_id, "train_adapter", map_index=0)
    assert re.search(rf"running on worker {worker_prefix()}[12]@", log), log[-2000:]


def test_retrain_day1_trains_candidates_that_wait_to_be_judged(live):
    rest, run_id, answered = live.rest(), f"retrain_{DAY1}", []
    rest.trigger("ctr_lora_retrain", run_id, DAY1)
    run = rest.wait("ctr_lora_retrain", run_id, on_poll=approve_all(rest, "ctr_lora_retrain", run_id, answered))
    assert run["state"] == "success", rest.task_instances("ctr_lora_retrain", run_id)
    assert answered == [], "a release was asked for before any candidate was judged"
    check_retrain(rest, run_id, DAY1, released=None)


def arrive(live, day: str) -> dict:
    """`ctr_lake_arrival` validates `day`; its Asset event starts one new run of each daily DAG by itself; every
    approval they ask for is answered; returns {dag_id: run_id} of those runs, each a success."""
    rest = live.rest()
    known = {d: {r["dag_run_id"] for r in rest.runs(d, run_type="asset_triggered")} for d in DAILY}
    rest.trigger("ctr_lake_arrival", f"arrival_{day}", conf={"day": day})
    assert rest.wait("ctr_lake_arrival", f"arrival_{day}")["state"] == "success"
    assert [e["extra"]["day"] for e in rest.asset_events(VALIDATED_URI)][-1] == day
    deadline, started = time.monotonic() + 180, {}
    while len(started) < len(DAILY) and time.monotonic() < deadline:
        started = {
            d: new[0]
            for d in DAILY
            if (
                new := [
                    r["dag_run_id"] for r in rest.runs(d, run_type="asset_triggered") if r["dag_run_id"] not in known[d]
                ]
            )
        }
        time.sleep(3)
    assert set(started) == set(DAILY), f"asset-triggered runs: {started}"
    answered: list = []
    for dag_id in DAILY:  # all three run at once; answer any approval while waiting for each
        polls = [approve_all(rest, d, r, answered) for d, r in started.items()]
        run = rest.wait(dag_id, started[dag_id], on_poll=lambda: [p() for p in polls])
        assert run["state"] == "success", (dag_id, rest.task_instances(dag_id, started[dag_id]))
    cold = versions("ctr_lora_cold_start")[-1]
    assert cold.tags["data.last"] == day and cold.tags["base.version"] == "1"
    assert cold.tags["gate.passed"] in ("true", "false")
    assert day in rest.task_log("ctr_champion_monitor", started["ctr_champion_monitor"], "monitor")
    return started


def test_a_validated_day_judges_yesterdays_candidates_and_releases_todays(live):
    started = arrive(live, DAY2)
    check_retrain(live.rest(), started["ctr_lora_retrain"], DAY2, released="champion")
    for slot in SLOTS:  # day 1's candidate, judged on day 2's rows (no champion: the first-run checks)
        v1 = versions(f"ctr_lora_{slot}")[0]
        assert v1.tags["judge.state"] == "release" and v1.tags["judge.handed_over"] == "2"


def test_the_next_day_judges_the_champions_and_releases_canaries_beside_them(live):
    started = arrive(live, DAY3)
    assert [e["extra"]["day"] for e in live.rest().asset_events(VALIDATED_URI)] == [DAY2, DAY3]
    check_retrain(live.rest(), started["ctr_lora_retrain"], DAY3, released="canary")
    for slot in SLOTS:  # the serving v2 judged on day 3's rows; v3 went to @canary next to it
        name = f"ctr_lora_{slot}"
        assert json.loads(versions(name)[1].tags["judge.evidence"])["last_day"] == DAY3
        assert alias_of(name) == "2" and versions(name)[2].tags["judge.replaced"] == "2"
        page = MlflowClient().get_registered_model(name).description  # what serves and why, on its page
        assert "| @champion | v2 |" in page and "| @canary | v3 (" in page and "passed gate" in page
        # how the slot is doing over days: one run, a line per role (day 2: v1 judged as a candidate; day 3: v2
        # judged as the champion it had become)
        line = run_of(name, slot)
        steps = {
            k: [m.step for m in MlflowClient().get_metric_history(line, k)] for k in ("candidate_auc", "champion_auc")
        }
        assert steps == {"candidate_auc": [day_step(DAY2)], "champion_auc": [day_step(DAY3)]}, steps


def serving(live, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{live.env['STACK_SERVE_PORT']}{path}",
        method="POST" if body else "GET",
        data=json.dumps(body).encode() if body else None,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    except OSError as exc:  # not listening yet: it waits for the first ctr_base@champion before it binds
        return 0, {"error": str(exc)}


def test_the_stacks_scoring_server_follows_the_registry(live):
    """`make stack` started `python -m pipelines serve` before anything was registered; by now it serves
    each slot's champion (v2) and canary (v3) as the registry says, with no restart."""
    want = {f"ctr_lora_{s}@{a}": f"ctr_lora_{s}:{v}" for s in SLOTS for a, v in (("champion", "2"), ("canary", "3"))}
    deadline, routes = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        code, health = serving(live, "/healthz")
        routes = serving(live, "/routes")[1].get("routes", {}) if code == 200 else {}
        if want.items() <= routes.items():
            break
        time.sleep(3)
    assert want.items() <= routes.items(), (routes, health)
    row = {
        "user_id": "1",
        "item_id": "50",
        "slot": "morning",
        "age_bucket": "25-34",
        "gender": "F",
        "occupation": "writer",
        "category": "Drama",
        "hour": 9,
        "weekday": 2,
        "is_new_user": False,
    }
    code, out = serving(live, "/invocations", {"dataframe_records": [row]})
    assert code == 200 and 0 < out["predictions"][0] < 1, out
    assert out["served_by"][0]["model"] == "ctr_lora_morning", out


def test_mapped_tasks_ran_on_both_celery_workers(live):
    """The per-slot tasks of the retrain runs were spread over the two workers (a task instance's id is
    in the log of the worker that executed it). Over all runs: Celery assigns each task to whichever
    worker has a free slot, so one run alone, sharing the workers with cold start and monitor, may
    land on one of them."""
    rest = live.rest()
    tis = [
        t
        for r in rest.runs("ctr_lora_retrain")
        for t in rest.task_instances("ctr_lora_retrain", r["dag_run_id"])
        if t["map_index"] >= 0 and t["task_id"] in ("train_adapter", "evaluate")
    ]
    assert len(tis) == 6 * len(SLOTS)  # three runs, two mapped tasks each
    ran_on = {w: sum(t["id"] in live.worker_log(w) for t in tis) for w in WORKERS}
    assert sum(ran_on.values()) == len(tis) and all(ran_on.values()), f"mapped task instances per worker: {ran_on}"


def test_model_ops_forms(live):
    rest = live.rest()
    canaries = [f"ctr_lora_{s}" for s in SLOTS if alias_of(f"ctr_lora_{s}", "canary")]
    assert canaries, "no day-3 candidate passed its gate: the canary paths would be untested"
    name = canaries[0]
    v1, v2 = alias_of(name), alias_of(name, "canary")
    for run_id, conf in (
        ("promote_canary", {"action": "promote_canary", "reason": "e2e: canary healthy"}),
        ("revert", {"action": "revert", "reason": "e2e: back to day 1"}),
        ("override", {"action": "override", "version": int(v2), "reason": "e2e: override by hand"}),
    ):
        rest.trigger("ctr_model_ops", run_id, conf={**conf, "model": name})
        assert rest.wait("ctr_model_ops", run_id)["state"] == "success", rest.task_instances("ctr_model_ops", run_id)
    moves = [(h["kind"], h["from_version"], h["to_version"]) for h in history(name)]
    assert moves[-3:] == [("promote", v1, v2), ("revert", v2, v1), ("override", v1, v2)]
    assert history(name)[-1]["reason"].startswith("e2e: override by hand")
    # an invalid form is refused by the API before any run exists
    bad = rest.trigger(
        "ctr_model_ops", "invalid", conf={"action": "revert", "model": "not a model", "reason": "x"}, ok=(400, 422)
    )
    assert "model" in bad.text or "reason" in bad.text
    events = rest.asset_events(f"mlflow://{name}/champion")
    assert len(events) >= 3


def test_a_user_retrains_approves_and_follows_the_links_in_a_browser(live, tmp_path):
    """The path a person clicks, in Debian's Chromium: sign in; trigger ctr_lora_retrain for day 4 from its form;
    watch train_adapter's instances, named by slot, succeed; approve each release in Required Actions; from a
    register instance's Details follow "MLflow model version" to the version's page, and from there to the model's
    page, whose description says what serves and why."""
    rest, run_id = live.rest(), f"browser_{DAY4}"
    with browser(tmp_path / "shots") as context:
        ui = AirflowUI(context.new_page(), live.airflow_url)
        ui.sign_in("admin", live.admin_password())
        ui.trigger("ctr_lora_retrain", run_id, {"end_day": DAY4})
        assert ui.wait_mapped("ctr_lora_retrain", run_id, "train_adapter", SLOTS)
        approved, deadline = [], time.monotonic() + 600
        while rest.run("ctr_lora_retrain", run_id)["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, rest.task_instances("ctr_lora_retrain", run_id)
            if not (subject := ui.approve_next(run_id)):
                time.sleep(3)
            approved += [subject] if subject else []
        tis = rest.task_instances("ctr_lora_retrain", run_id)
        assert rest.run("ctr_lora_retrain", run_id)["state"] == "success", tis
        assert [(t["task_id"], t["map_index"]) for t in tis if t["try_number"] > 1] == []
        assert approved, "day 4 asked for no release: the approval path went unclicked"
        model, version = re.search(r"release (ctr_lora_\w+) v(\d+) ", approved[0]).groups()
        register = next(t for t in tis if t["task_id"] == "register" and f"ctr_lora_{t['rendered_map_index']}" == model)
        page = ui.follow_extra_link(
            "ctr_lora_retrain", run_id, "register", register["map_index"], "MLflow model version"
        )
        assert page.url.endswith(f"/#/models/{model}/versions/{version}"), page.url
        page.get_by_text(f"Version {version}", exact=True).wait_for()
        serves = model_page_description(page, model)
    released = next(a for a in ("canary", "champion") if alias_of(model, a) == version)
    rows = {line.split("\t")[0]: line for line in serves.splitlines()}
    assert rows[f"@{released}"].split("\t")[1].startswith(f"v{version}"), serves
    assert "approved by admin" in rows[f"@{released}"] and run_id in rows[f"@{released}"], serves
    assert rows["@champion"].split("\t")[1] == f"v{alias_of(model)}", serves


def test_no_task_of_any_run_needed_a_second_try(live):
    """Every task instance of every run in this module (REST and browser, scheduled and asset-triggered) passed
    or was refused on its first try: a retry that hides a bug counts as a failure."""
    rest = live.rest()
    runs = [
        (d, r["dag_run_id"])
        for d in ("ctr_base_model", "ctr_model_ops", "ctr_lake_arrival", *DAILY)
        for r in rest.runs(d)
    ]
    assert len(runs) >= 15
    retried = [
        (d, r, t["task_id"], t["map_index"], t["try_number"])
        for d, r in runs
        for t in rest.task_instances(d, r)
        if t["try_number"] > 1
    ]
    assert retried == []


def test_stack_down_stops_every_process_it_started(live):
    """Last in the module: `make stack-down` stops each component by the PID `up` recorded, children
    included (each runs in a session of its own), and leaves no PID file behind."""
    pids = {p.stem: int(p.read_text()) for p in (live.dir / "pids").glob("*.pid")}
    assert set(pids) == {"s3", "mlflow", "api-server", "scheduler", "dag-processor", "triggerer", *WORKERS, "serve"}
    down = live.cli("down")
    assert down.returncode == 0, down.stderr
    for comp, pid in pids.items():
        assert f"{comp}: stopped" in down.stdout or f"{comp}: killed" in down.stdout
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # no process of its group is left
    assert not list((live.dir / "pids").glob("*.pid"))
    assert live.cli("status").returncode == 1
