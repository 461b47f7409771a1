"""The report every example under ``examples/`` ends with: one ``ok``/``FAIL`` line per check, then ``PASS`` or
``FAIL`` (runs in the example's process).

An example's ``run`` fills a dict ``check -> None`` (ok) or ``why it failed``; any exception it raises becomes the
failed check "the example ran to the end", so the last line is always the verdict (examples/README contract: exit 0
if and only if the last line starts with ``PASS``).
"""

from __future__ import annotations

from collections.abc import Callable

#: An example's checks: the check's sentence -> None when it held, else why it failed.
Checks = dict[str, str | None]


def run_checks(run: Callable[[Checks], None]) -> int:
    """Run ``run(checks)``, print each check and the verdict; returns the exit status (0 iff every check held and
    there was at least one).

    Args:
        run: the example's body; it records its checks in the dict it is given and may raise (recorded as a
            failed check naming the exception).
    """
    checks: Checks = {}
    try:
        run(checks)
    except Exception as exc:  # noqa: BLE001 - the example reports every failure as its last line
        checks["the example ran to the end"] = f"{type(exc).__name__}: {exc}"
    for name, why in checks.items():
        print(f"ok {name}" if why is None else f"FAIL {name}: {why}", flush=True)
    failed = [name for name, why in checks.items() if why is not None]
    print("PASS" if checks and not failed else f"FAIL {'; '.join(failed)}", flush=True)
    return 0 if checks and not failed else 1
