"""The model card (pipelines/registry/model_card.py: render) says what each figure means, never a bare None."""

from pipelines.registry.model_card import render

TAGS = {
    "slot": "night",
    "data.first": "1998-02-24",
    "data.last": "1998-03-02",
    "data.partitions": "7",
    "data.sha256": "1ffe840b47b8313a",
    "base.name": "ctr_base",
    "base.version": "1",
    "base.fingerprint": "79a53069f890",
    "config.hash": "0c600add27c67570",
    "code.version": "9a18c14",
    "training.run_id": "1016928f",
}


def judged(sequential: dict) -> dict:
    return {
        "candidate": {"auc": 0.79, "rows": 303},
        "champion": None,
        "judged_day": "1998-03-02",
        "holdout_rows": 303,
        "sequential": sequential,
    }


def test_a_first_version_has_no_paired_rows_and_the_card_says_why():
    first = {"days": 1, "n": None, "verdict": "release", "reason": "no champion yet: the first-run checks decide"}
    card = render("ctr_lora_night", "2", TAGS, judged(first))
    assert "Sequential test over 1 judged day(s), no paired rows (no champion): release" in card
    assert "None" not in card


def test_a_judged_candidate_counts_the_rows_it_was_paired_on():
    seq = {"days": 2, "n": 512, "verdict": "wait", "reason": "the interval still spans the margin"}
    assert "Sequential test over 2 judged day(s), 512 paired rows: wait" in render("m", "3", TAGS, judged(seq))
