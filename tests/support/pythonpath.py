"""The repo root on ``PYTHONPATH``, for the subprocesses a test starts that import test helpers.

pytest puts the repo root on its own import path (``pythonpath`` in pyproject.toml); a child
Python (``python -c ...``, a worker script) gets it from its environment instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The repository root, where ``tests`` (the test helpers' package) lives.
REPO = Path(__file__).resolve().parents[2]


def repo_on_pythonpath(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) whose ``PYTHONPATH`` starts with :data:`REPO`,
    keeping what it held."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    return out
