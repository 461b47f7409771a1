"""mypy over every package, with a baseline only for the code that runs inside engines.

Run from the repository root (``make lint`` does, after linking ``build/typecheck/stitchboard/<part>``
to each top-level folder: the editable install maps ``stitchboard.<part>`` to those folders with
an import hook that mypy cannot follow, so mypy reads them through the links instead).

``proto/``, ``bulletin/``, ``trainer_client/``, ``demo/`` and the sidecar service must have no
error; the first three are checked with every flag of ``mypy --strict`` (pyproject.toml's override
section; ``tests/test_typecheck_config.py`` keeps it equal to ``--strict``). Code inside engine
processes (``sidecar/engines/<engine>/`` but the adapters) may keep the errors listed in
``.ci/mypy-baseline.txt`` (one ``path: message`` a line, line numbers left out, so unrelated edits
do not churn it) and no others; a listed error that is gone fails too,
until the line is removed: the baseline only shrinks. Exit status 1 on any failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKS = "build/typecheck/stitchboard/"
PARTS = ["proto", "bulletin", "trainer_client", "sidecar", "demo"]
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*)$")


def _in_engine(path: str) -> bool:
    return path.startswith("sidecar/engines/") and not path.endswith(
        ("/adapter.py", "/launch.py", "engines/base.py", "engines/__init__.py")
    )


def main() -> int:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *(LINKS + p for p in PARTS)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    errors = []
    for line in run.stdout.splitlines():
        m = _ERROR.match(line)
        if m:
            errors.append((m["path"].removeprefix(LINKS), m["message"], line.replace(LINKS, "")))
    if run.returncode not in (0, 1) or (run.returncode == 1 and not errors):
        print(run.stdout, run.stderr, sep="\n")
        return 1
    allowed = (
        [line for line in BASELINE.read_text().splitlines() if line and not line.startswith("#")]
        if BASELINE.exists()
        else []
    )
    new = [full for path, message, full in errors if not (_in_engine(path) and f"{path}: {message}" in allowed)]
    seen = {f"{path}: {message}" for path, message, _ in errors}
    gone = [entry for entry in allowed if entry not in seen]
    for full in new:
        print(full)
    for entry in gone:
        print(f"{BASELINE.relative_to(ROOT)}: fixed, remove the line: {entry}")
    print(
        f"mypy: {len(errors)} errors, {len(errors) - len(new)} of them in the engine-side baseline "
        f"({len(allowed)} lines); {len(new)} new, {len(gone)} fixed"
    )
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
