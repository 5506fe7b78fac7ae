"""A release manager answering Airflow's human-in-the-loop requests, for end-to-end tests.

Run as `python -m tests.e2e.hitl_respond --dag D --answers '{"<model>": "Approve" | "Reject"}'` with the
stack's environment (its metadata DB). It waits for the pending approval of each named model (found
by the model name in the request body), then answers through the Core API's own handler,
`update_hitl_detail` (what `PATCH .../hitlDetails` runs in an api-server), with a real DB session.
Only the HTTP layer and the login are skipped. `airflow dags test` resumes the parked task from
there, exactly as it would after an answer in the UI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.datamodels.hitl import UpdateHITLDetailPayload
from airflow.api_fastapi.core_api.routes.public.hitl import update_hitl_detail
from airflow.models.hitl import HITLDetail
from airflow.models.taskinstance import TaskInstance as TI
from airflow.utils.session import create_session
from sqlalchemy import select


def pending(dag_id: str) -> list[tuple[str, str, int, str]]:
    """(run_id, task_id, map_index, body) of unanswered requests of `dag_id`."""
    with create_session() as session:
        rows = session.execute(
            select(TI.run_id, TI.task_id, TI.map_index, HITLDetail.body)
            .join(HITLDetail, HITLDetail.ti_id == TI.id)
            .where(TI.dag_id == dag_id, HITLDetail.responded_at.is_(None))
        ).all()
    return [(r, t, m, b or "") for r, t, m, b in rows]


def answer(dag_id: str, run_id: str, task_id: str, map_index: int, option: str, user: str) -> None:
    with create_session() as session:
        update_hitl_detail(
            dag_id=dag_id,
            dag_run_id=run_id,
            task_id=task_id,
            map_index=map_index,
            update_hitl_detail_payload=UpdateHITLDetailPayload(chosen_options=[option]),
            user=SimpleAuthManagerUser(username=user, role="admin"),
            session=session,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dag", required=True)
    p.add_argument("--answers", required=True, help='JSON {"<model name>": "Approve" | "Reject"}')
    p.add_argument("--user", default="release-manager")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    todo = dict(json.loads(a.answers))
    deadline = time.monotonic() + a.timeout
    while todo and time.monotonic() < deadline:
        for run_id, task_id, map_index, body in pending(a.dag):
            model = next((m for m in todo if f"**{m} v" in body), None)
            if model is not None:
                answer(a.dag, run_id, task_id, map_index, todo.pop(model), a.user)
                print(f"answered {model}: {task_id}[{map_index}] in {run_id}", flush=True)
        time.sleep(1)
    if todo:
        print(f"no approval request came for {sorted(todo)} within {a.timeout:.0f} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
