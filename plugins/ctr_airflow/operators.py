"""Thin Airflow operators over `pipelines.promotion`: each calls one library entry function
(`aliases.promote / revert / promote_canary / withdraw_canary`, `release.gate_and_release / release /
record_approval / override`) and nothing else.

Keyword-only __init__ with no I/O; templated fields; the work happens in execute(). A version given
to an operator is normalised once, here (`_version`), and passed on as the library's `str`; text
fields (model, reason) are coerced to `str` here too (`_text`): a Param such as reason "12345"
renders to an int in a DAG with `render_template_as_native_obj`. A refusal is pushed to XCom (key
`error` / `decision`) and then raised as a typed exception that fails the task without retrying,
because re-running a refused move gives the same answer. The policy (approval, rejections, stale
gates) is the library's to enforce (`pipelines.promotion.release`), not the DAG's shape.

Every alias move is made with an operation id naming the task instance, so a retried or cleared
task returns the recorded move instead of moving the alias again, and it emits an Airflow Asset
event `mlflow://<model>/<alias>` (through the asset alias `ctr-model-aliases`) that deployment DAGs
can schedule on. Registry writes run in the pool `ctr_registry` (one slot; see `registry_write`).
"""

from __future__ import annotations

from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from ctr_airflow.dag_defaults import REGISTRY_POOL
from ctr_airflow.links import LINKS, remember, remembered
from ctr_airflow.runtime import actor

MOVES = AssetAlias("ctr-model-aliases")


class ModelMoveRefused(AirflowFailException):
    """A promote, revert, release or override was refused (missing version, never gated, incompatible base, ...)."""


class CandidateRejected(AirflowFailException):
    """A candidate failed its gate and the operator was told to fail on rejection."""


def registry_write(moves: bool = True) -> dict:
    """The pool (and, with `moves`, the asset alias of alias moves) of a task that writes to the
    registry, for `@task(...)` and `.partial(...)`: a mapped operator's __init__ defaults only apply
    once unmapped, after the scheduler has already picked the pool."""
    return {"pool": REGISTRY_POOL, **({"outlets": [MOVES]} if moves else {})}


def _version(v):
    """The edge where an operator's version argument becomes the library's `str` (Params render to
    native types); an empty or 'None' version means 'not given', anything else that is not a positive
    integer is refused (`aliases.version_id`, a PipelineError)."""
    if v in (None, "", "None"):
        return None
    from pipelines.promotion.aliases import version_id

    return version_id(v)


def _text(value, what: str) -> str:
    """The edge where a templated text field (a Param rendered natively: "12345" becomes 12345) becomes
    the library's `str`: numbers are written back as text; anything else (None, a list, ...) is
    refused as a PipelineError, which the operator turns into a refusal. Length: the library's limit."""
    from pipelines.errors import PipelineError

    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise PipelineError(f"{what} must be text, got {type(value).__name__} {value!r}")


def op_id(context) -> str:
    """The task instance that asks for a move (stable across retries of the same run)."""
    ti = context["ti"]
    index = getattr(ti, "map_index", -1)
    return f"airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}" + (f"[{index}]" if index is not None and index >= 0 else "")


def asset_uri(model: str, alias: str) -> str:
    return f"mlflow://{model}/{alias}"


def emit_move(context, move: dict) -> None:
    """An Asset event for an alias that moved, or on `mlflow://<model>/held` for a release that was held (with
    why and what releases it); nothing for a no-op or a replayed move."""
    if move.get("held"):
        extra = {
            "kind": "held",
            "from_version": str(move.get("from_version") or ""),  # the canary watched
            "to_version": str(move.get("held_version") or ""),
            "reason": str(move.get("reason")),
        }
        context["outlet_events"][MOVES].add(Asset(asset_uri(move["model"], "held")), extra=extra)
        return
    if not move.get("moved"):
        return
    extra = {k: str(move.get(k) or "") for k in ("kind", "from_version", "to_version", "reason", "actor")}
    context["outlet_events"][MOVES].add(Asset(asset_uri(move["model"], move["alias"])), extra=extra)


def _each_move(result: dict | list[dict]):
    """The moves in an operator's result: one, several, and a promoted canary's withdrawal."""
    for m in result if isinstance(result, list) else [result]:
        yield m
        if m.get("withdrawn"):
            yield m["withdrawn"]


class _MoveOperator(BaseOperator):
    """Runs one pipelines move; refusals become ModelMoveRefused, moves become Asset events."""

    what = "move"
    operator_extra_links = LINKS

    def __init__(self, **kwargs):
        kwargs.setdefault("outlets", [MOVES])
        kwargs.setdefault("pool", REGISTRY_POOL)
        super().__init__(**kwargs)

    def move(self, context) -> dict | list[dict]:
        raise NotImplementedError

    def execute(self, context):
        from pipelines.errors import PipelineError

        try:
            for field in ("model", "reason"):  # rendered Params, before any use
                if hasattr(self, field):
                    setattr(self, field, _text(getattr(self, field), field))
            result = self.move(context)
        except PipelineError as exc:
            context["ti"].xcom_push(key="error", value={"model": getattr(self, "model", None), "error": str(exc)})
            raise ModelMoveRefused(f"{self.what} of {getattr(self, 'model', '?')} refused: {exc}") from exc
        first = next(_each_move(result), {})
        remember(self, {"model": first.get("model"), "version": first.get("to_version") or first.get("held_version")})
        for m in _each_move(result):
            emit_move(context, m)
            if m.get("held"):
                raise_held(self.log, m)
            self.log.info(
                "%s@%s: %s -> %s (%s)",
                m.get("model"),
                m.get("alias"),
                m.get("from_version"),
                m.get("to_version"),
                "moved" if m.get("moved") else "nothing to do",
            )
        return result


def raise_held(log, move: dict):
    """A release that was held ends its task skipped, saying what is held, why and what releases it (the
    version's `release.held` tag says the same): never a success that reads "nothing to do"."""
    log.warning("HELD %s v%s: %s", move.get("model"), move.get("held_version"), move.get("reason"))
    raise AirflowSkipException(f"held: {move.get('reason')}")


class RevertModelVersionOperator(_MoveOperator):
    """Move `<model>@champion` back to the previous champion (or `to_version`), recorded in the history."""

    template_fields = ("model", "to_version", "reason")
    what = "revert"

    def __init__(self, *, model: str, reason: str, to_version: int | str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.model, self.reason, self.to_version = model, reason, to_version

    def move(self, context):
        from pipelines.promotion import aliases

        return aliases.revert(
            self.model,
            reason=self.reason,
            to_version=_version(self.to_version),
            actor=actor(context),
            op_id=op_id(context),
        )


class _CanaryMoveOperator(_MoveOperator):
    """Ends `<model>`'s canary by hand, for a reason (see PromoteCanaryOperator, WithdrawCanaryOperator)."""

    template_fields = ("model", "reason")

    def __init__(self, *, model: str, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.model, self.reason = model, reason


class PromoteCanaryOperator(_CanaryMoveOperator):
    """`<model>@canary` becomes `@champion` and `@canary` is removed: two recorded moves, two Asset events."""

    what = "canary promotion"

    def move(self, context):
        from pipelines.promotion import aliases

        return aliases.promote_canary(self.model, reason=self.reason, actor=actor(context), op_id=op_id(context))


class WithdrawCanaryOperator(_CanaryMoveOperator):
    """`<model>@canary` is removed; the champion keeps serving everyone."""

    what = "canary withdrawal"

    def move(self, context):
        from pipelines.promotion import aliases

        return aliases.withdraw_canary(self.model, reason=self.reason, actor=actor(context), op_id=op_id(context))


class _VersionMoveOperator(_MoveOperator):
    """A move of `<model>` to a named version, asked for by a person with a reason."""

    template_fields = ("model", "version", "reason")

    def __init__(self, *, model: str, version: int | str, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.model, self.version, self.reason = model, version, reason

    def move(self, context):
        from pipelines.errors import PipelineError

        version = _version(self.version)
        if version is None:
            raise PipelineError(f"{self.what} needs a version")
        return self.move_to(version, actor=actor(context), op_id=op_id(context))

    def move_to(self, version: str, *, actor: str, op_id: str) -> dict:
        raise NotImplementedError


class PromoteModelVersionOperator(_VersionMoveOperator):
    """Make a gated version `<model>@champion` by hand (e.g. after a revert), recorded in the history.
    Refused for a version a person rejected (that is `override`) and, when the gate policy (read
    now, `policy_path`) or its gate asked for one, for a version without a recorded approval."""

    template_fields = ("model", "version", "reason", "policy_path")
    what = "promotion"

    def __init__(self, *, model: str, version: int | str, reason: str, policy_path: str | None = None, **kwargs):
        super().__init__(model=model, version=version, reason=reason, **kwargs)
        self.policy_path = policy_path

    def move_to(self, version, *, actor, op_id):
        from pipelines.config import load_gate_policy
        from pipelines.promotion import aliases

        return aliases.promote(
            self.model,
            version,
            reason=self.reason,
            actor=actor,
            op_id=op_id,
            require_approval=load_gate_policy(self.policy_path or None).approval,
        )


class OverrideGateOperator(_VersionMoveOperator):
    """Release a version the gate rejected, by a person with a reason; never past base compatibility."""

    what = "override"

    def move_to(self, version, *, actor, op_id):
        from pipelines.promotion import release

        return release.override(self.model, version, reason=self.reason, actor=actor, op_id=op_id)


class ReleaseOperator(_MoveOperator):
    """Release a gated candidate (`decision` from GatedPromotionOperator) to @canary or @champion.

    `approval_task_id`: the HITL ApprovalOperator that must have recorded "Approve" (same map index)
    before anything moves; the approver's name goes into the recorded reason. Without a recorded
    answer (e.g. the approval task was marked success by hand) the release is refused.
    """

    template_fields = ("decision", "policy_path")
    what = "release"

    def __init__(
        self, *, decision: dict, policy_path: str | None = None, approval_task_id: str | None = None, **kwargs
    ):
        super().__init__(**kwargs)
        self.decision, self.policy_path, self.approval_task_id = decision, policy_path, approval_task_id

    def _approver(self, context) -> str | None:
        """The approver's name; a recorded "Reject" skips the release (Airflow's own skip of the
        downstream task does not reach a mapped task group's instances), no answer refuses it."""
        if not self.approval_task_id:
            return None
        ti, version = context["ti"], _version(self.decision["version"])
        answer = ti.xcom_pull(task_ids=self.approval_task_id, map_indexes=ti.map_index)
        chosen = list(answer.get("chosen_options") or []) if isinstance(answer, dict) else []
        if chosen not in (["Approve"], ["Reject"]):
            raise ModelMoveRefused(
                f"release of {self.model} v{version} refused: no recorded answer from "
                f"{self.approval_task_id} (got {answer!r})"
            )
        from pipelines.promotion import release

        user = answer.get("responded_by_user") or {}
        who = user.get("name") or user.get("id") or "unknown user"
        release.record_approval(
            self.model, version, answer=chosen[0], by=who, at=str(answer.get("responded_at") or ""), task=op_id(context)
        )
        if chosen == ["Reject"]:
            raise AirflowSkipException(f"{self.model} v{version}: release rejected by {who}; nothing moves")
        return who

    def move(self, context):
        from pipelines.config import load_gate_policy
        from pipelines.promotion import release

        self.model = _text(self.decision["model"], "model")
        remember(self, {"model": self.model, "version": self.decision["version"]})  # linked even when refused
        policy = load_gate_policy(self.policy_path or None)
        self._approver(context)  # records the answer on the version, which release() then reads
        return release.release(
            policy, self.model, _version(self.decision["version"]), actor=actor(context), op_id=op_id(context)
        )


class GatedPromotionOperator(BaseOperator):
    """Run the gate for a registered candidate and, unless `release=False`, release it when it passes.

    `registered` is the dict returned by `pipelines.registry.register.register` (model, version,
    evaluation), or `pipelines.promotion.prequential.hand_over`'s; one without an evaluation
    (a prequential day where nothing is ready) ends the task as skipped, with its reason. A rejected candidate ends
    the task as skipped (nothing downstream runs, the
    champion is untouched) or, with `fail_on_reject=True`, as failed. With `release=False` a
    ReleaseOperator (after a human approval) does the move.
    """

    template_fields = ("registered", "policy_path")
    operator_extra_links = LINKS

    def __init__(
        self,
        *,
        registered: dict,
        policy_path: str | None = None,
        fail_on_reject: bool = False,
        release: bool = True,
        **kwargs,
    ):
        kwargs.setdefault("outlets", [MOVES])
        kwargs.setdefault("pool", REGISTRY_POOL)
        super().__init__(**kwargs)
        self.registered, self.policy_path, self.fail_on_reject, self.release = (
            registered,
            policy_path,
            fail_on_reject,
            release,
        )

    def execute(self, context):
        from pipelines.config import load_gate_policy
        from pipelines.errors import PipelineError
        from pipelines.promotion import release

        r = self.registered
        remember(self, {"model": r.get("model"), "version": r.get("version")})  # linked whatever the verdict
        if r.get("evaluation") is None:  # a prequential candidate: nothing is ready to gate today
            raise AirflowSkipException(r.get("reason") or f"{r.get('model')}: nothing to gate")
        try:
            decision = release.gate_and_release(
                load_gate_policy(self.policy_path or None),
                r["model"],
                _version(r["version"]),
                r["evaluation"],
                actor=actor(context),
                op_id=op_id(context),
                release_on_pass=self.release,
                on_move=lambda m: emit_move(context, m),
            )
        except PipelineError as exc:  # e.g. a pass the policy does not let go out without an approval
            context["ti"].xcom_push(key="error", value={"model": r.get("model"), "error": str(exc)})
            raise ModelMoveRefused(f"gate and release of {r.get('model')} v{r.get('version')} refused: {exc}") from exc
        if decision["passed"] and (decision.get("release") or {}).get("held"):
            context["ti"].xcom_push(key="decision", value=decision)
            raise_held(self.log, {"model": r["model"], "held_version": r["version"], **decision["release"]})
        if decision["passed"]:  # with the version's MLflow page, for the approval's body
            return {**decision, "links": remembered(self)}
        context["ti"].xcom_push(key="decision", value=decision)
        msg = f"{r['model']} v{r['version']} rejected by the gate; @champion stays at v{decision['champion_version']}"
        if self.fail_on_reject:
            raise CandidateRejected(msg)
        raise AirflowSkipException(msg)
