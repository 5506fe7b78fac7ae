"""Thin Airflow operators over `pipelines.promotion`.

Keyword-only __init__ with no I/O; templated fields; the work happens in execute(). A refusal is
pushed to XCom (key `error` / `decision`) and then raised as a typed exception that fails the task
without retrying, because re-running a refused move gives the same answer.
"""
from __future__ import annotations

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from ctr_airflow.runtime import actor


class ModelMoveRefused(AirflowFailException):
    """A promote or revert was refused (missing version, never gated, incompatible base, ...)."""


class CandidateRejected(AirflowFailException):
    """A candidate failed its gate and the operator was told to fail on rejection."""


def _version(v):
    """Params render to native types; an empty or 'None' version means 'not given'."""
    return None if v in (None, "", "None") else str(int(v))


class RevertModelVersionOperator(BaseOperator):
    """Move `<model>@champion` back to the previous champion (or `to_version`), recorded in the history."""

    template_fields = ("model", "to_version", "reason")

    def __init__(self, *, model: str, reason: str, to_version: int | str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.model, self.reason, self.to_version = model, reason, to_version

    def execute(self, context):
        from pipelines.errors import PipelineError
        from pipelines.promotion import aliases

        try:
            result = aliases.revert(self.model, reason=self.reason, to_version=_version(self.to_version),
                                    actor=actor(context))
        except PipelineError as exc:
            context["ti"].xcom_push(key="error", value={"model": self.model, "error": str(exc)})
            raise ModelMoveRefused(f"revert of {self.model} refused: {exc}") from exc
        self.log.info("%s@champion: %s -> %s (%s)", self.model, result["from_version"], result["to_version"],
                      "moved" if result["moved"] else "already there, nothing to do")
        return result


class PromoteModelVersionOperator(BaseOperator):
    """Make a gated version `<model>@champion` by hand (e.g. after a revert), recorded in the history."""

    template_fields = ("model", "version", "reason")

    def __init__(self, *, model: str, version: int | str, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.model, self.version, self.reason = model, version, reason

    def execute(self, context):
        from pipelines.errors import PipelineError
        from pipelines.promotion import aliases

        version = _version(self.version)
        try:
            if version is None:
                raise PipelineError("promote needs a version")
            result = aliases.promote(self.model, version, reason=self.reason, actor=actor(context))
        except PipelineError as exc:
            context["ti"].xcom_push(key="error", value={"model": self.model, "error": str(exc)})
            raise ModelMoveRefused(f"promotion of {self.model} v{version} refused: {exc}") from exc
        self.log.info("%s@champion: %s -> %s", self.model, result["from_version"], result["to_version"])
        return result


class GatedPromotionOperator(BaseOperator):
    """Run the gate for a registered candidate; promote it to @champion when it passes.

    `registered` is the dict returned by `pipelines.registry.register.register` (model, version,
    evaluation). A rejected candidate ends the task as skipped (the champion is untouched) or, with
    `fail_on_reject=True`, as failed.
    """

    template_fields = ("registered", "policy_path")

    def __init__(self, *, registered: dict, policy_path: str | None = None, fail_on_reject: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.registered, self.policy_path, self.fail_on_reject = registered, policy_path, fail_on_reject

    def execute(self, context):
        from pipelines.config import load_gate_policy
        from pipelines.promotion import gate

        r = self.registered
        decision = gate.run(load_gate_policy(self.policy_path), r["model"], r["version"], r["evaluation"],
                            actor=actor(context))
        if decision["passed"]:
            return decision
        context["ti"].xcom_push(key="decision", value=decision)
        msg = f"{r['model']} v{r['version']} rejected by the gate; @champion stays at v{decision['champion_version']}"
        if self.fail_on_reject:
            raise CandidateRejected(msg)
        raise AirflowSkipException(msg)
