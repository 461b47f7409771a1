"""mypy's --strict for proto, bulletin and trainer_client, as pyproject.toml's per-module flags.

mypy applies ``strict = true`` to every module even inside an override section, so pyproject lists
the flags --strict enables one by one; this test keeps that list equal to what the pinned mypy's
``--help`` says --strict enables (a mypy upgrade that adds a flag fails here until it is added).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STRICT_PACKAGES = {"stitchboard.proto.*", "stitchboard.bulletin.*", "stitchboard.trainer_client.*"}
#: --strict's flags that mypy reads only from the global section.
GLOBAL_ONLY = {"warn_redundant_casts", "warn_unused_configs"}


def strict_flags() -> dict[str, bool]:
    """Config key -> value of each flag ``mypy --strict`` enables, from ``mypy --help``."""
    env = {**os.environ, "COLUMNS": "1000"}  # argparse wraps help at the terminal's width: one line each
    help_text = subprocess.run(
        [sys.executable, "-m", "mypy", "--help"], check=True, capture_output=True, text=True, env=env, timeout=60
    ).stdout
    listed = re.search(r"--strict\s+Strict mode; enables the following flags: ([^\n]+)", help_text)
    assert listed is not None, "mypy --help no longer lists --strict's flags"
    flags = {}
    for flag in listed[1].split(","):
        name = flag.strip().removeprefix("--").replace("-", "_")
        if name.startswith("no_"):
            flags[name.removeprefix("no_")] = False
        else:
            flags[name] = True
    return flags


def test_the_three_packages_get_every_strict_flag():
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = strict_flags()
    assert len(strict) >= 10, strict
    sections = [o for o in mypy["overrides"] if STRICT_PACKAGES <= set(o["module"])]
    assert len(sections) == 1, "one override section names proto, bulletin and trainer_client"
    per_module = {k: v for k, v in sections[0].items() if k != "module"}
    assert "strict" not in per_module and "strict" not in mypy, "mypy applies `strict` to every module"
    assert per_module == {k: v for k, v in strict.items() if k not in GLOBAL_ONLY}
    assert mypy.get("warn_redundant_casts") is True  # global only; warn_unused_configs checks the config, not code
