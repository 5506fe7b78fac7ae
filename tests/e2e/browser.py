"""A user's hands on the Airflow and MLflow UIs: Playwright's Python client driving Debian's Chromium.

Playwright's own browser download does not work here (no internet), so the browser is the system's
(`apt-get install chromium`; .ci/run installs it). Where it or Playwright is missing, the test skips
saying which. Every page the test leaves open is screenshotted into `shots` when a step fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# No phoning home from the browser either: updates, metrics, field trials and sync stay off.
_FLAGS = [
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--metrics-recording-only",
    "--no-first-run",
]


def chromium_path() -> str:
    path = os.environ.get("CTR_CHROMIUM") or shutil.which("chromium") or ""
    if not path:
        pytest.skip(
            "Debian's Chromium is not installed (apt-get install chromium; .ci/run installs it): "
            "the browser test needs a real browser"
        )
    return path


@contextlib.contextmanager
def browser(shots: Path):
    """A fresh headless Chromium context (1400x1000). On an exception, each open page is saved as
    shots/<n>.png before the browser closes."""
    try:
        from playwright.sync_api import sync_playwright  # noqa: PLC0415 optional: the test skips without Playwright
    except ImportError:
        pytest.skip("Playwright's Python package is not installed (requirements.txt pins it)")
    path = chromium_path()
    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=path, args=_FLAGS)
        context = chrome.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(30_000)
        try:
            yield context
        except BaseException:
            shots.mkdir(parents=True, exist_ok=True)
            for i, page in enumerate(context.pages):
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(shots / f"{i}.png"), full_page=True)
            print(f"browser screenshots: {shots}")
            raise
        finally:
            chrome.close()


@dataclass
class AirflowUI:
    """The Airflow 3 UI as a person clicks it (selectors are its visible labels, not its markup)."""

    page: object
    base_url: str

    def sign_in(self, username: str, password: str) -> None:
        self.page.goto(f"{self.base_url}/")
        self.page.get_by_label("Username").fill(username)
        self.page.get_by_label("Password").fill(password)
        self.page.get_by_role("button", name="Sign in").click()
        self.page.wait_for_url(re.compile(rf"^{re.escape(self.base_url)}/?$"))

    def trigger(self, dag_id: str, run_id: str, params: dict[str, str]) -> None:
        """The DAG page's Trigger form: each run parameter typed into its field, the run id under
        Advanced Options; lands on the new run's page."""
        self.page.goto(f"{self.base_url}/dags/{dag_id}")
        self.page.get_by_role("button", name="Trigger").click()
        form = self.page.get_by_role("dialog")
        for name, value in params.items():
            form.locator(f"#element_{name}").fill(value)
        form.get_by_role("button", name="Advanced Options").click()
        form.locator("input[name=dagRunId]").fill(run_id)
        form.get_by_role("button", name="Trigger", exact=True).click()
        self.page.wait_for_url(f"{self.base_url}/dags/{dag_id}/runs/{run_id}")

    def mapped_states(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str]:
        """{map index as the list shows it: state} of a mapped task's instances in a run."""
        self.page.goto(f"{self.base_url}/dags/{dag_id}/runs/{run_id}/tasks/{task_id}/mapped")
        self.page.get_by_text(re.compile(r"^\d+ Task Instances?$")).wait_for()
        states = {}
        for row in self.page.get_by_role("row").all()[1:]:
            cells = [c.inner_text().strip() for c in row.get_by_role("cell").all()]
            if len(cells) > 2:
                states[cells[1]] = cells[2]
        return states

    def wait_mapped(self, dag_id: str, run_id: str, task_id: str, labels, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while (states := self.mapped_states(dag_id, run_id, task_id)) != {label: "Success" for label in labels}:
            if time.monotonic() > deadline or "Failed" in states.values():
                raise AssertionError(f"{dag_id}/{run_id} {task_id}: {states}")
            time.sleep(3)
        return states

    def approve_next(self, run_id: str) -> str | None:
        """In Required Actions, open the first pending approval of `run_id`, press Approve, and return its
        subject once the UI confirms the response; None when nothing of that run is pending."""
        self.page.goto(f"{self.base_url}/required_actions")
        self.page.get_by_text(re.compile(r"^\d+ Required Actions?$")).wait_for()
        pending = self.page.get_by_role("row").filter(has_text="Approval Required").filter(has_text=run_id)
        if pending.count() == 0:
            return None
        subject = pending.first.get_by_role("link").first
        text = subject.inner_text()
        subject.click()
        self.page.get_by_role("button", name="Approve").click()
        self.page.get_by_text(re.compile(r"^Response received at .* from ")).wait_for()
        return text

    def follow_extra_link(self, dag_id: str, run_id: str, task_id: str, map_index: int, name: str):
        """Open the task instance's Details, click the extra link `name`, return the page it opens."""
        self.page.goto(f"{self.base_url}/dags/{dag_id}/runs/{run_id}/tasks/{task_id}/mapped/{map_index}/details")
        with self.page.context.expect_page() as opened:
            self.page.get_by_role("link", name=name).click()
        return opened.value


def model_page_description(version_page, model: str) -> str:
    """From an MLflow model version's page, follow the breadcrumb to the registered model's page and
    return its description's 'What serves' table as text (one row per line, cells tab-separated)."""
    version_page.get_by_role("link", name=model, exact=True).click()
    version_page.get_by_text(f"What serves {model}").wait_for()
    return version_page.get_by_role("table").filter(has_text="@champion").first.inner_text()
