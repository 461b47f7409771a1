"""The examples' shared report (demo/example_checks.py): exit 0 iff every check held, last line the verdict."""

from __future__ import annotations

import pytest

from stitchboard.demo.example_checks import Checks, run_checks


def _held(checks: Checks) -> None:
    checks["a"] = None
    checks["b"] = None


def _one_failed(checks: Checks) -> None:
    checks["a"] = None
    checks["b"] = "b differs"


def _raised(checks: Checks) -> None:
    checks["a"] = None
    raise ValueError("boom")


def _nothing(checks: Checks) -> None:
    pass


@pytest.mark.parametrize(
    ("body", "status", "lines"),
    [
        (_held, 0, ["ok a", "ok b", "PASS"]),
        (_one_failed, 1, ["ok a", "FAIL b: b differs", "FAIL b"]),
        (_raised, 1, ["ok a", "FAIL the example ran to the end: ValueError: boom", "FAIL the example ran to the end"]),
        (_nothing, 1, ["FAIL "]),
    ],
)
def test_the_last_line_is_the_verdict(capsys, body, status, lines):
    assert run_checks(body) == status
    assert capsys.readouterr().out.splitlines() == lines
