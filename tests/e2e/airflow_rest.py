"""A user's view of a running Airflow: the public REST API v2, JWT from `POST /auth/token`.

Only what the stack e2e needs: unpause, trigger (with a form's conf), poll a run to the end, read task
instances, answer human-in-the-loop requests, read asset events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

FINISHED = {"success", "failed"}


class RestError(AssertionError):
    pass


@dataclass
class AirflowREST:
    base_url: str
    username: str
    password: str
    token: str = ""

    def _client(self) -> httpx.Client:
        if not self.token:
            r = httpx.post(
                f"{self.base_url}/auth/token", json={"username": self.username, "password": self.password}, timeout=30
            )
            if r.status_code not in (200, 201):
                raise RestError(f"login failed: {r.status_code} {r.text}")
            self.token = r.json()["access_token"]
        return httpx.Client(
            base_url=f"{self.base_url}/api/v2", timeout=60, headers={"Authorization": f"Bearer {self.token}"}
        )

    def request(self, method: str, path: str, ok=(200,), **kw) -> httpx.Response:
        with self._client() as c:
            r = c.request(method, path, **kw)
        if r.status_code not in ok:
            raise RestError(f"{method} {path} -> {r.status_code}: {r.text[:2000]}")
        return r

    def wait_for_dags(self, dag_ids, timeout_s: float = 300) -> None:
        """Until the DAG processor has parsed every one of `dag_ids` (a DAG whose config appeared after the
        stack started is an import error until its file is parsed again); fails with the import errors."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = {d["dag_id"] for d in self.request("GET", "/dags", params={"limit": 100}).json()["dags"]}
            if set(dag_ids) <= found:
                return
            if time.monotonic() > deadline:
                errors = self.request("GET", "/importErrors").json().get("import_errors", [])
                raise RestError(
                    f"DAGs {sorted(set(dag_ids) - found)} not parsed within {timeout_s:.0f} s; "
                    f"import errors: {[(e.get('filename'), e.get('stack_trace', '')[-300:]) for e in errors]}"
                )
            time.sleep(3)

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def trigger(
        self, dag_id: str, run_id: str, logical_date: str | None = None, conf: dict | None = None, ok=(200,)
    ) -> httpx.Response:
        body = {
            "dag_run_id": run_id,
            "logical_date": f"{logical_date}T00:00:00Z" if logical_date else None,
            "conf": conf or {},
        }
        return self.request("POST", f"/dags/{dag_id}/dagRuns", json=body, ok=ok)

    def runs(self, dag_id: str, run_type: str | None = None) -> list[dict]:
        params = {"limit": 100, **({"run_type": run_type} if run_type else {})}
        return self.request("GET", f"/dags/{dag_id}/dagRuns", params=params).json()["dag_runs"]

    def run(self, dag_id: str, run_id: str) -> dict:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}").json()

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000}).json()[
            "task_instances"
        ]

    def wait(self, dag_id: str, run_id: str, timeout_s: float = 1200, on_poll=None) -> dict:
        """Poll until the run finishes; `on_poll()` runs between polls (e.g. to answer approvals)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.run(dag_id, run_id)
            if run["state"] in FINISHED:
                return run
            if on_poll:
                on_poll()
            time.sleep(3)
        states = {(t["task_id"], t["map_index"]): t["state"] for t in self.task_instances(dag_id, run_id)}
        raise RestError(f"{dag_id}/{run_id} still {run['state']} after {timeout_s:.0f} s: {states}")

    def task_log(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, try_number: int = 1) -> str:
        """The task's log as the UI shows it: one line per structured record (its `event` text)."""
        r = self.request(
            "GET",
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"map_index": map_index, "full_content": True},
            headers={"Accept": "application/json"},
        )
        content = r.json()["content"]
        return "\n".join(
            f"[{c.get('level', '')}] {c.get('event', '')}" if isinstance(c, dict) else str(c) for c in content
        )

    def extra_links(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, str | None]:
        """The task instance's extra links as the UI shows them: {name: URL, or None while it has none}."""
        r = self.request(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/links", params={"map_index": map_index}
        )
        return r.json()["extra_links"]

    def pending_approvals(self, dag_id: str, run_id: str) -> list[dict]:
        details = self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/hitlDetails").json()["hitl_details"]
        return [d for d in details if not d.get("response_received")]

    def answer(self, detail: dict, option: str) -> dict:
        ti = detail["task_instance"]
        path = (
            f"/dags/{ti['dag_id']}/dagRuns/{ti['dag_run_id']}/taskInstances/{ti['task_id']}/"
            f"{ti['map_index']}/hitlDetails"
        )
        return self.request("PATCH", path, json={"chosen_options": [option]}).json()

    def asset_events(self, uri: str) -> list[dict]:
        assets = self.request("GET", "/assets", params={"uri_pattern": uri, "limit": 100}).json()["assets"]
        ids = [a["id"] for a in assets if a["uri"] == uri]
        if not ids:
            return []
        return self.request("GET", "/assets/events", params={"asset_id": ids[0], "limit": 1000}).json()["asset_events"]
