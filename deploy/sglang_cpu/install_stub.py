"""Install the ``sgl_kernel`` stand-in (./sgl_kernel) into the running interpreter's environment.

Run by ``make venv-sglang`` with ``.venv-sglang/bin/python``. Refuses (exit 1, nothing left
installed) when:

* a real ``sgl_kernel`` is importable (the stand-in must never shadow the real kernel);
* SGLang would take an AMX path with the stand-in in place. SGLang 0.5.23 gates every use of
  ``sgl_kernel`` on ``cpu_has_amx_support()``: the CPU reports AMX (``amx_tile`` in
  /proc/cpuinfo, as torch reads it) *and* the real kernel's torch op
  ``torch.ops.sgl_kernel.convert_weight_packed`` is registered. The stand-in registers no op, so
  the gate stays closed on any CPU; this script checks that after installing, on AMX CPUs and
  others alike, and removes the stand-in if it is open.

Every stub call is also recorded (``STITCH_SGL_KERNEL_STUB_LOG``) and raises; the tests and the
demo fail when any was recorded.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
GATE_CHECK = (
    "from sglang.srt.utils.common import cpu_has_amx_support, is_amx_tile_supported; "
    "print(int(is_amx_tile_supported), int(cpu_has_amx_support()))"
)


def _cpu_reports_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def main() -> int:
    sys.path[:] = [
        p for p in sys.path if Path(p or ".").resolve() != HERE
    ]  # look for a real kernel, not at ./sgl_kernel
    target = Path(sysconfig.get_paths()["purelib"]) / "sgl_kernel"
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and spec.origin and not (target / "__init__.py").exists():
        print(f"a real sgl_kernel is installed ({spec.origin}): not installing stitchboard's stand-in", file=sys.stderr)
        return 1
    if (target / "__init__.py").exists() and "STITCHBOARD_STUB = True" not in (target / "__init__.py").read_text():
        print(f"{target} is not stitchboard's stand-in: not replacing it", file=sys.stderr)
        return 1
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(HERE / "sgl_kernel", target, ignore=shutil.ignore_patterns("__pycache__"))
    answer = subprocess.run([sys.executable, "-c", GATE_CHECK], capture_output=True, text=True, check=False)
    flags = answer.stdout.split()
    if answer.returncode != 0 or flags[-1:] != ["0"]:
        shutil.rmtree(target, ignore_errors=True)
        print(
            f"with the stand-in installed SGLang's AMX gate is not closed ({answer.stdout.strip()} "
            f"{answer.stderr[-500:]}): removed it",
            file=sys.stderr,
        )
        return 1
    amx = _cpu_reports_amx()
    print(
        f"sgl_kernel stand-in installed at {target} (CPU reports AMX: {amx}; torch AMX tile support: "
        f"{flags[0] == '1'}; SGLang's AMX gate: closed)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
