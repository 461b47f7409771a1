"""proto.adapter: the AdapterSpec on a manifest, view checksums and adapter names (issue #31)."""

from __future__ import annotations

import json
import re

import pytest
import xxhash

from stitchboard.proto.adapter import AdapterSpec, adapter_name, parse_adapter_name, spec_mismatch, view_checksum
from stitchboard.proto.errors import SchemaError
from stitchboard.proto.fleet import ReplicaReport
from stitchboard.proto.schema import canonical_json, parse_manifest

#: A full run's manifest as written before adapter runs existed (canonical bytes).
OLD_MANIFEST = (
    b'{"base_version":0,"encoding":"xor","files":[{"path":"patch-v1.safetensors","role":"patch",'
    b'"sha256":"' + b"a" * 64 + b'","size_bytes":100}],"metadata":{"step":7},'
    b'"run_id":"run-1","schema_version":1,"served":"bf16","snapshot":false,'
    b'"stats":{"changed_elements":2,"encoded_bytes":100,"total_elements":6},'
    b'"tensors":[{"checksums":{"xxh3_128":"' + b"0" * 32 + b'"},"dtype":"BF16","name":"model.w","shape":[2,3]}],'
    b'"version":1}'
)
CHECKSUM = "0123456789abcdef0123456789abcdef"


def lora_config(**changes: object) -> dict[str, object]:
    """A PEFT LoraConfig.to_dict()-shaped config (JSON-safe) for base ``tiny/base``."""
    config: dict[str, object] = {
        "peft_type": "LORA",
        "base_model_name_or_path": "tiny/base",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["v_proj", "q_proj"],
        "use_rslora": False,
        "lora_dropout": 0.0,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "modules_to_save": None,
    }
    config.update(changes)
    return config


def spec(**changes: object) -> AdapterSpec:
    fields: dict[str, object] = {
        "base_model": "tiny/base",
        "base_checksum": CHECKSUM,
        "r": 4,
        "lora_alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        "config": lora_config(),
    }
    fields.update(changes)
    return AdapterSpec.model_validate(fields)


def test_full_run_manifest_bytes_unchanged_and_adapter_round_trips() -> None:
    manifest = parse_manifest(OLD_MANIFEST)
    assert manifest.adapter is None
    assert canonical_json(manifest) == OLD_MANIFEST
    raw = json.loads(OLD_MANIFEST)
    with_adapter = parse_manifest({**raw, "adapter": spec().model_dump(mode="json")})
    again = parse_manifest(canonical_json(with_adapter))
    assert again.adapter == spec() and canonical_json(again) == canonical_json(with_adapter)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"config": lora_config(r=8)}, "config['r']"),
        ({"config": lora_config(base_model_name_or_path="other")}, "base_model_name_or_path"),
        ({"config": lora_config(target_modules=["q_proj"])}, "target_modules"),
        ({"target_modules": ["v_proj", "q_proj"]}, "sorted"),
        ({"config": lora_config(use_dora=True)}, "use_dora"),
        ({"config": lora_config(modules_to_save=["lm_head"])}, "modules_to_save"),
        ({"config": lora_config(x=float("nan"))}, "plain JSON"),
        ({"base_checksum": "xyz"}, "base_checksum"),
        ({"r": 0, "config": lora_config(r=0)}, "r"),
    ],
)
def test_spec_refuses(changes: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        spec(**changes)


def test_spec_mismatch_names_the_field() -> None:
    assert spec_mismatch(spec(), spec(config=lora_config(lora_dropout=0.1))) is None
    assert spec_mismatch(None, None) is None
    assert spec_mismatch(None, spec()) == ("adapter", "full", "adapter")
    assert spec_mismatch(spec(), spec(r=8, config=lora_config(r=8))) == ("r", 4, 8)
    other = spec(base_checksum="f" * 32)
    assert spec_mismatch(spec(), other) == ("base_checksum", CHECKSUM, "f" * 32)
    pattern = spec(config=lora_config(rank_pattern={"q_proj": 2}))
    assert spec_mismatch(spec(), pattern) == ("config.rank_pattern", {}, {"q_proj": 2})
    assert spec_mismatch(spec(config=lora_config(rank_pattern=None)), spec()) is None


def test_view_checksum_is_xxh3_of_sorted_lines() -> None:
    sums = {"b.weight": "2" * 32, "a.weight": "1" * 32}
    text = f"a.weight\t{'1' * 32}\nb.weight\t{'2' * 32}\n"
    assert view_checksum(sums) == xxhash.xxh3_128_hexdigest(text.encode())
    assert view_checksum(dict(reversed(sums.items()))) == view_checksum(sums)
    with pytest.raises(SchemaError, match="empty"):
        view_checksum({})
    with pytest.raises(SchemaError, match="tab"):
        view_checksum({"a\tb": "1" * 32})


def test_adapter_names() -> None:
    assert adapter_name("grpo-lora", 12) == "grpo-lora@12"
    assert parse_adapter_name("grpo-lora@12") == ("grpo-lora", 12)
    assert parse_adapter_name("grpo-lora") == ("grpo-lora", None)
    for bad in ("r@", "r@-1", "r@x", "r@1@2", "@3", "r@１"):
        with pytest.raises(SchemaError):
            parse_adapter_name(bad)
    with pytest.raises(SchemaError):
        adapter_name("r", -1)


def test_replica_report_lists_resident_adapter_versions() -> None:
    base = {"replica_id": "r-0", "engine": "vllm", "applied_version": 1, "target_version": 1, "state": "ready"}
    common = {**base, "lag_versions": 0, "healthy": True, "started_at": 1.8e9}
    assert ReplicaReport.model_validate(common).adapters == []
    report = ReplicaReport.model_validate({**common, "adapters": ["lora-run@1", "lora-run@2"]})
    assert ReplicaReport.model_validate_json(report.model_dump_json()).adapters == ["lora-run@1", "lora-run@2"]
    for bad in (["lora-run"], ["lora-run@x"], [f"r@{i}" for i in range(65)]):
        with pytest.raises(ValueError, match="adapter|64"):
            ReplicaReport.model_validate({**common, "adapters": bad})
