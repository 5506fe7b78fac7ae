"""The registered model's description says what serves and why, rewritten at every alias move, on a
real MLflow store; a version the gate or a person rejects loses @candidate and is tagged `rejected`."""

from __future__ import annotations

from mlflow import MlflowClient

from pipelines.promotion import aliases, gate_record, release
from pipelines.registry import description
from tests.pipelines.promotion.test_aliases import MODEL, add_version
from tests.pipelines.promotion.test_release import CANARY, FP, registry  # noqa: F401 (fixture)


def page(name: str = MODEL) -> str:
    return MlflowClient().get_registered_model(name).description or ""


def test_render_lists_each_alias_with_since_move_and_why_and_the_rejected():
    block = description.render(
        MODEL,
        {
            "canary": {
                "version": "3",
                "tags": {"canary.share": "0.1", "gate.passed": "true"},
                "at": "2026-12-06T10:00",
                "kind": "canary",
                "actor": "airflow",
                "reason": "passed gate",
            },
            "champion": {
                "version": "2",
                "tags": {},
                "at": "2026-12-05T09:00",
                "kind": "revert",
                "actor": "ana",
                "reason": "CTR | dropped",
            },
        },
        rejected=[("4", "gate: auc_floor failed against v2")],
        held=[],
        now="now",
    )
    rows = [line for line in block.splitlines() if line.startswith("| @")]
    assert rows[0].startswith("| @champion | v2 | 2026-12-05T09:00 | revert by ana | CTR \\| dropped; not gated |")
    assert rows[1].startswith("| @canary | v3 (10% of users) |")
    assert "Rejected: v4 (gate: auc_floor failed against v2)" in block
    assert block.startswith(description.BEGIN) and block.endswith(description.END)


def test_merged_keeps_what_a_person_wrote_and_replaces_only_the_block():
    first = description.merged("Owner: ads-ml team.", "B1".join([description.BEGIN, description.END]))
    again = description.merged(first + "\nSee the runbook.", "B2".join([description.BEGIN, description.END]))
    assert again.startswith("Owner: ads-ml team.") and again.endswith("See the runbook.")
    assert "B2" in again and "B1" not in again


def test_every_alias_move_rewrites_the_description(tracking):
    v1, v2 = add_version(MODEL), add_version(MODEL)
    aliases.promote(MODEL, v1, reason="first champion", actor="ana")
    assert "| @champion | v1 |" in page() and "promote by ana | first champion" in page()
    aliases.promote(MODEL, v2, reason="passed gate against v1", actor="airflow")
    aliases.revert(MODEL, reason="CTR fell 20% for 3 windows", actor="bob")
    text = page()
    assert "| @champion | v1 |" in text and "revert by bob | CTR fell 20% for 3 windows" in text
    assert text.count(description.BEGIN) == 1


def test_a_gate_rejection_takes_candidate_off_and_tags_the_version(tracking):
    v1 = add_version(MODEL, gate_passed="pending")
    MlflowClient().set_registered_model_alias(MODEL, "candidate", v1)
    failed = {
        "passed": False,
        "first_run": True,
        "champion_version": None,
        "checks": [{"name": "auc_floor", "value": 0.4, "threshold": 0.55, "passed": False, "reason": "low"}],
    }
    gate_record.record(MODEL, v1, failed, None)
    mv = MlflowClient().get_model_version(MODEL, v1)
    assert "candidate" not in mv.aliases and mv.tags[description.REJECTED_TAG] == "gate: auc_floor failed"
    assert str(MlflowClient().search_model_versions(f"name = '{MODEL}' and tags.rejected != ''")[0].version) == v1
    assert "Rejected: v1 (gate: auc_floor failed)" in page()


def test_a_persons_rejection_is_shown_and_outlives_a_new_passing_gate(tracking):
    v1 = add_version(MODEL)
    release.record_approval(MODEL, v1, answer="Reject", by="ana", at="now", task="approve_release")
    passed = {"passed": True, "first_run": True, "champion_version": None, "checks": []}
    gate_record.record(MODEL, v1, passed, None)
    assert MlflowClient().get_model_version(MODEL, v1).tags[description.REJECTED_TAG].startswith("rejected by ana")
    release.override(MODEL, v1, reason="reviewed offline: fine", actor="bob")
    assert description.REJECTED_TAG not in MlflowClient().get_model_version(MODEL, v1).tags
    assert "| @champion | v1 |" in page() and "Rejected" not in page()


def test_a_held_release_is_listed_with_its_reason(registry):
    v4 = add_version(MODEL, base__fingerprint=FP, gate__champion_version="1")
    release.release(CANARY, MODEL, "1", actor="t")  # first run: champion
    release.release(CANARY, MODEL, "2", actor="t")  # passed against v1: canary
    assert release.release(CANARY, MODEL, v4, actor="t")["held"]  # held behind the watched canary
    assert f"Held: v{v4} (" in page() and "| @canary | v2 (20% of users) |" in page()


def test_a_rejection_leaves_candidate_alone_once_a_newer_version_holds_it(tracking):
    v1, v2 = add_version(MODEL, gate_passed="pending"), add_version(MODEL, gate_passed="pending")
    MlflowClient().set_registered_model_alias(MODEL, "candidate", v2)  # registered while v1's gate ran
    description.reject(MODEL, v1, "gate: auc_floor failed")
    assert str(MlflowClient().get_registered_model(MODEL).aliases["candidate"]) == v2


def test_candidate_since_is_its_registration(tracking):
    v1 = add_version(MODEL, gate_passed="pending")
    MlflowClient().set_registered_model_alias(MODEL, "candidate", v1)
    row = next(line for line in description.publish(MODEL).splitlines() if line.startswith("| @candidate"))
    since = row.split("|")[3].strip()
    assert since[:4].isdigit() and "T" in since, row  # an ISO time, not "-"
    assert "| registered |" in row and "waiting for its gate" in row
