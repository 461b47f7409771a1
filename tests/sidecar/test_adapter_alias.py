"""Aliases of an adapter run's versions (``sidecar/adapter_alias.py``): TRL's ``trl-policy-v{N}``, prime-rl's loaded
names."""

from __future__ import annotations

import pytest

from stitchboard.sidecar.adapter_alias import AdapterAliases


def test_trl_policy_names_are_the_runs_versions() -> None:
    aliases = AdapterAliases("grpo-lora")
    assert aliases.resolve("trl-policy-v0") == "grpo-lora@0"
    assert aliases.resolve("trl-policy-v12") == "grpo-lora@12"


@pytest.mark.parametrize(
    "model", ["trl-policy", "trl-policy-v", "trl-policy-v-1", "trl-policy-v3x", "trl-policy-v٣", "grpo-lora", "demo", 3]
)
def test_other_names_are_no_alias(model: object) -> None:
    assert AdapterAliases("grpo-lora").resolve(model) is None


def test_a_bound_name_stands_for_its_version_until_unbound() -> None:
    aliases = AdapterAliases("grpo-lora")
    assert aliases.bind("policy", 3) is None
    assert aliases.resolve("policy") == "grpo-lora@3"
    assert aliases.bind("policy", 5) == 3  # loaded again: moved to the newer version
    assert aliases.resolve("policy") == "grpo-lora@5"
    assert aliases.bind("trl-policy-v1", 4) is None  # a bound name wins over TRL's pattern
    assert aliases.resolve("trl-policy-v1") == "grpo-lora@4"
    assert aliases.unbind("policy") == 5 and aliases.resolve("policy") is None
    assert aliases.unbind("policy") is None
