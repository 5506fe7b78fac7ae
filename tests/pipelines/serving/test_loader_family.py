"""serving.loader refuses an adapter version whose recorded model family is not the served base's, with that
reason (the base fingerprint would refuse it too, less legibly)."""

from __future__ import annotations

import pytest

from pipelines.registry import integrity
from pipelines.serving.loader import RefusedVersion, VersionRef, _check_base

FP = "f" * 64
META = {"base": {"name": "ctr_base", "version": "1", "fingerprint": FP}}


def ref(**tags) -> VersionRef:
    return VersionRef("ctr_lora_feed", "3", {"base.fingerprint": FP, **tags})


def test_an_adapter_of_another_family_is_refused_as_base_mismatch():
    with pytest.raises(RefusedVersion, match="trained on a 'dcn' base, the served base is a 'minilm_text' one") as e:
        _check_base(ref(**{integrity.FAMILY_TAG: "dcn"}), META, FP, "minilm_text")
    assert e.value.reason == "base_mismatch"


def test_the_same_family_or_a_version_without_the_tag_passes_on_to_the_fingerprint_check():
    _check_base(ref(**{integrity.FAMILY_TAG: "dcn"}), META, FP, "dcn")
    _check_base(ref(), META, FP, "dcn")  # registered before adapters recorded their family
    with pytest.raises(RefusedVersion, match="fingerprint"):
        _check_base(ref(), META, "0" * 64, "dcn")
