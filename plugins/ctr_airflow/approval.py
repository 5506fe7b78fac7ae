"""The human-in-the-loop release step: gate (no release) >> Airflow's ApprovalOperator >> release.

Used by ctr_lora_retrain (one step per adapter, in a task group mapped over the registered
candidates) and ctr_cold_start (one step) when the gate policy says `approval: true`. Inside a
mapped task group the three tasks of index i depend only on each other, so rejecting one slot's
candidate (or its gate failing) skips that slot's release and nobody else's; with plain mapped
tasks `approve >> release`, one rejection skipped every slot's release.

The release reads the answer of the approval task of its own index: "Approve" releases and puts
the approver in the alias history's reason; "Reject" skips it (the ApprovalOperator's own skip of
its downstream does not reach the instances of a mapped group); no answer (the approval task
marked success by hand) refuses it. Either answer is recorded on the version (`release.approval`),
and the library's `release` reads it from there: the approval is a rule of the release, enforced for
every caller, and this group is only how Airflow asks for it.
"""

from __future__ import annotations

from ctr_airflow.operators import GatedPromotionOperator, ReleaseOperator

GROUP = "approval"
GATE, APPROVE, RELEASE = f"{GROUP}.gate_and_promote", f"{GROUP}.approve_release", f"{GROUP}.release"
# Rendered when the approval task runs: the gate's decision of the same map index.
_DECISION = "{% set d = ti.xcom_pull(task_ids='" + GATE + "', map_indexes=ti.map_index) %}"
# The line the Required actions list shows: which model, which version, what serves now, the decision asked.
SUBJECT = (
    _DECISION + "{{ what }}: release {{ d.model }} v{{ d.version }}"
    "{% if d.champion_version %} (serving: v{{ d.champion_version }}){% else %} (its first version){% endif %}?"
)
BODY = (
    _DECISION + "**{{ d.model }} v{{ d.version }}** passed its gate"
    "{% if d.champion_version %} against champion v{{ d.champion_version }}{% else %} (first version){% endif %}. "
    "Approve to release it as the gate policy says (canary or champion); its model card and gate report "
    "are on the version in the MLflow registry"
    "{% if (d.get('links') or {}).get('version') %}: [{{ d.model }} v{{ d.version }}]({{ d.links.version }})"
    "{% endif %}."
    "{% if d.get('would_hold') %}\n\n**Approving will not release it now.** {{ d.get('would_hold') }}.{% endif %}"
)


def gate_approve_release(registered, what: str):
    """Call inside a task group whose group_id is GROUP; `what` names the kind of model in the subject (e.g.
    "CTR adapter"). Returns the release task."""
    from airflow.providers.standard.operators.hitl import ApprovalOperator

    gated = GatedPromotionOperator(task_id="gate_and_promote", registered=registered, release=False)
    approve = ApprovalOperator(
        task_id="approve_release",
        subject=SUBJECT.replace("{{ what }}", what),
        body=BODY,
        map_index_template=_DECISION + "{{ d.model if d else '' }}",
    )
    release = ReleaseOperator(task_id="release", decision=gated.output, approval_task_id=APPROVE)
    gated >> approve >> release
    return release
