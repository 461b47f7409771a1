"""Stand-in for SGLang's ``sgl_kernel`` on a CPU host without the real kernel (tests and demo only).

SGLang 0.5.23 imports ``*_cpu`` names from ``sgl_kernel`` at module load, but PyPI has no CPU
build of it. Every use of those names is gated on ``cpu_has_amx_support()``, which also needs
the real kernel's registered torch op ``torch.ops.sgl_kernel.convert_weight_packed``; this module
registers no op, so SGLang takes its ``torch_native`` paths. Every attribute here is a function
that records its call (one line appended to the file named by ``STITCH_SGL_KERNEL_STUB_LOG``) and
raises ``NotImplementedError``: a stub can never stand in for work. The SGLang tests and the
demo fail when that file holds any line. Installed into ``.venv-sglang`` only by ``make
venv-sglang`` (deploy/sglang_cpu/install_stub.py), never next to a real ``sgl_kernel``.
"""

from __future__ import annotations

import os
import time
from typing import Any, NoReturn

#: Environment variable naming the file that records every call of a stub.
LOG_ENV = "STITCH_SGL_KERNEL_STUB_LOG"
#: Marks this module as the stand-in (checked by the installer and the tests).
STITCHBOARD_STUB = True


def _stub(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.time():.3f} pid={os.getpid()} sgl_kernel.{name} called with {len(args)} args\n")
        raise NotImplementedError(
            f"sgl_kernel.{name}: this is stitchboard's stand-in (deploy/sglang_cpu); "
            "the real sgl_kernel is not installed on this host"
        )

    call.__name__ = call.__qualname__ = name
    return call


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _stub(name)
