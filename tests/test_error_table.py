"""The reference's error table (docs/reference/errors.md) names every error type a client can get:
each wire type of the bulletin, sidecar and trainer exception trees appears in a table row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stitchboard.bulletin.errors import BulletinError
from stitchboard.proto.errors import wire_types
from stitchboard.sidecar.errors import SidecarError
from stitchboard.trainer_client.errors import TrainerError

TABLE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md"


def _documented() -> set[str]:
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("|")]
    return {name for row in rows for name in re.findall(r"`([A-Za-z]+)`", row)}


@pytest.mark.parametrize("root", [BulletinError, SidecarError, TrainerError], ids=lambda r: r.__name__)
def test_every_error_type_has_a_row(root: type) -> None:
    missing = sorted(set(wire_types(root)) - _documented() - {"TrainerError"})
    assert not missing, f"add these error types to {TABLE.name}: {missing}"
