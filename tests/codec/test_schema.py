"""Wire schema validation: lineage, names, shapes, dtypes, sizes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stitchboard.proto import SchemaError, VersionManifest, canonical_json, check_run_id, parse_manifest

SUM = {"xxh3_128": "0" * 32}
SHA = "a" * 64


def manifest(**over) -> dict:
    m = {
        "run_id": "run-1",
        "version": 1,
        "base_version": 0,
        "snapshot": False,
        "encoding": "xor",
        "tensors": [{"name": "model.w", "dtype": "BF16", "shape": [2, 3], "checksums": SUM}],
        "files": [{"path": "patch-v1.safetensors", "sha256": SHA, "size_bytes": 100, "role": "patch"}],
        "stats": {"changed_elements": 2, "total_elements": 6, "encoded_bytes": 100},
        "metadata": {"step": 7, "loss": 1.5},
    }
    m.update(over)
    return m


def test_valid_manifest_round_trips_canonically():
    m = parse_manifest(manifest())
    again = parse_manifest(canonical_json(m))
    assert canonical_json(again) == canonical_json(m)
    assert m.schema_version == 1 and m.tensors[0].numel == 6 and m.files_of("patch")[0].size_bytes == 100


def test_version_zero_is_an_anchor():
    snap = [{"path": "model.safetensors", "sha256": SHA, "size_bytes": 12, "role": "snapshot"}]
    ok = parse_manifest(
        manifest(
            version=0,
            base_version=None,
            snapshot=True,
            files=snap,
            stats={"changed_elements": 0, "total_elements": 6, "encoded_bytes": 0},
        )
    )
    assert ok.snapshot
    with pytest.raises(SchemaError, match="anchor"):
        parse_manifest(
            manifest(
                version=0,
                base_version=None,
                snapshot=False,
                files=[],
                stats={"changed_elements": 0, "total_elements": 6, "encoded_bytes": 0},
            )
        )
    with pytest.raises(SchemaError, match="cannot carry patch"):
        parse_manifest(manifest(version=0, base_version=None, snapshot=True, files=snap + manifest()["files"]))


@pytest.mark.parametrize("base", [0, 5, None])
def test_base_must_be_previous_version(base):
    with pytest.raises(SchemaError, match="base_version"):
        parse_manifest(manifest(version=3, base_version=base))


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "/abs/path", "a\x00b", "a\x1fb", "end\x7f", "C:evil", "a\\b", "x/../y", "a//b", ""]
)
def test_bad_names_are_rejected(name):
    t = [{"name": name, "dtype": "BF16", "shape": [6], "checksums": SUM}]
    with pytest.raises(SchemaError, match="invalid tensor name"):
        parse_manifest(manifest(tensors=t))
    f = [{"path": name, "sha256": SHA, "size_bytes": 100, "role": "patch"}]
    with pytest.raises(SchemaError, match="invalid file path"):
        parse_manifest(manifest(files=f))


@pytest.mark.parametrize("shape", [[-1, 6], [2**40, 2**40], [1] * 17])
def test_bad_shapes_are_rejected(shape):
    with pytest.raises(SchemaError, match="shape"):
        parse_manifest(manifest(tensors=[{"name": "w", "dtype": "BF16", "shape": shape, "checksums": SUM}]))


def test_unknown_dtype_and_missing_checksum():
    with pytest.raises(SchemaError, match="unknown dtype"):
        parse_manifest(manifest(tensors=[{"name": "w", "dtype": "BF17", "shape": [6], "checksums": SUM}]))
    with pytest.raises(SchemaError, match="xxh3_128"):
        parse_manifest(manifest(tensors=[{"name": "w", "dtype": "BF16", "shape": [6], "checksums": {"crc": "00"}}]))


def test_stats_must_agree_with_tensors_and_files():
    with pytest.raises(SchemaError, match="total_elements"):
        parse_manifest(manifest(stats={"changed_elements": 2, "total_elements": 7, "encoded_bytes": 100}))
    with pytest.raises(SchemaError, match="encoded_bytes"):
        parse_manifest(manifest(stats={"changed_elements": 2, "total_elements": 6, "encoded_bytes": 99}))


def test_future_schema_unknown_fields_and_bad_json():
    with pytest.raises(SchemaError, match="upgrade"):
        parse_manifest(manifest(schema_version=2))
    with pytest.raises(SchemaError, match="Extra inputs"):
        parse_manifest(manifest(created_at="2026-01-01"))
    with pytest.raises(SchemaError):
        parse_manifest(b"{not json")
    with pytest.raises(SchemaError, match="sha256"):
        parse_manifest(manifest(files=[{"path": "p", "sha256": "XYZ", "size_bytes": 100, "role": "patch"}]))


@pytest.mark.parametrize("run", ["..", "a/b", "-x", "", "a" * 129, "ok..no"])
def test_bad_run_ids(run):
    with pytest.raises(SchemaError):
        check_run_id(run)
    assert check_run_id("run_1.v2-a") == "run_1.v2-a"


@pytest.mark.parametrize("name", ["model.layers.0.w", "dir/ab:c.w", "caf\u00e9.w", "tab\u00a0w"])
def test_good_names_pass(name):
    t = [{"name": name, "dtype": "BF16", "shape": [2, 3], "checksums": SUM}]
    assert parse_manifest(manifest(tensors=t)).tensors[0].name == name


def test_layout_follows_a_copy_with_other_tensors():
    m = parse_manifest(manifest())
    assert m.layout() == {("model.w", "BF16", (2, 3))}
    grown = m.model_copy(update={"tensors": [m.tensors[0].model_copy(update={"shape": [3, 2]})]})
    assert grown.layout() == {("model.w", "BF16", (3, 2))}
    assert m.model_copy(update={"version": 2, "base_version": 1}).layout() is m.layout()
    assert m == parse_manifest(manifest()) and parse_manifest(manifest()) == m  # made or not, equal manifests
    assert canonical_json(m) == canonical_json(parse_manifest(manifest())) and "_stitch" not in m.model_dump_json()


def test_manifest_is_immutable():
    m = VersionManifest.model_validate(manifest())
    with pytest.raises(ValidationError, match="frozen"):
        m.version = 2  # type: ignore[misc]


def test_a_tensor_in_parts_carries_xxh3_128_parts_and_its_layout():
    parted = {"name": "model.w", "dtype": "BF16", "shape": [2, 3], "checksums": {"xxh3_128_parts": "1" * 32}}
    ok = VersionManifest.model_validate(manifest(tensors=[{**parted, "parts": [[1, 0, 2], [1, 2, 3]]}]))
    assert ok.tensors[0].parts == [(1, 0, 2), (1, 2, 3)]
    assert '"parts":[[1,0,2],[1,2,3]]' in canonical_json(ok).decode()
    assert "parts" not in canonical_json(VersionManifest.model_validate(manifest())).decode()  # older bytes unchanged
    for bad in (None, [[0, 0, 1]], [[0, 0, 1], [0, 2, 2]], [[0, 0, 1], [1, 1, 3]], [[2, 0, 2]]):
        with pytest.raises(ValidationError, match="xxh3_128_parts|parts"):
            VersionManifest.model_validate(manifest(tensors=[{**parted, "parts": bad}]))
