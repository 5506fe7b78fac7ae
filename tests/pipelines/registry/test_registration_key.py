"""registry.register.registration_key: what makes two candidates the same registered version."""

from pipelines.registry.register import registration_key

CANDIDATE = {"data": {"sha256": "d" * 64}, "config_hash": "c" * 64, "base": {"fingerprint": "b" * 64}}


def test_the_key_names_data_config_code_and_base():
    key = registration_key("ctr_lora_feed", CANDIDATE, "git:abc")
    assert key == registration_key("ctr_lora_feed", dict(CANDIDATE), "git:abc")
    assert key != registration_key("ctr_lora_feed", CANDIDATE, "git:abd")
    assert key != registration_key("ctr_lora_feed", {**CANDIDATE, "base": {"fingerprint": "e" * 64}}, "git:abc")
    # no penalty, or a penalty with no sibling yet: the same key as before siblings existed
    assert key == registration_key("ctr_lora_feed", {**CANDIDATE, "orthogonality": None}, "git:abc")


def against(*siblings: str) -> dict:
    return {**CANDIDATE, "orthogonality": {"siblings": list(siblings)}}


def test_an_adapter_trained_against_other_sibling_champions_is_another_version():
    one = registration_key("ctr_lora_feed", against("ctr_lora_search:1", "ctr_lora_night:2"), "git:abc")
    assert one == registration_key("ctr_lora_feed", against("ctr_lora_night:2", "ctr_lora_search:1"), "git:abc")
    assert one != registration_key("ctr_lora_feed", against("ctr_lora_search:3", "ctr_lora_night:2"), "git:abc")
    assert one != registration_key("ctr_lora_feed", CANDIDATE, "git:abc")
