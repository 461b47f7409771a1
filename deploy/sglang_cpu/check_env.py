"""Check the SGLang environment ``make venv-sglang`` built (run with ``.venv-sglang/bin/python``).

* torch is 2.14.1 and sglang 0.5.23, and stitchboard's loader imports;
* ``pip check`` reports nothing but the requirements of sglang that requirements-cpu.txt leaves
  out on purpose (CUDA-only packages and ones the CPU server never imports): every other
  complaint, e.g. a pin of sglang that stitchboard's install changed, fails.
"""

from __future__ import annotations

import re
import subprocess
import sys

#: sglang 0.5.23 requirements deliberately not installed (see requirements-cpu.txt).
LEFT_OUT = {
    "anthropic", "blobfile", "build", "cuda-python", "datasets", "deepseek-recipe", "flash-attn-4",
    "flashinfer-python", "humming-kernels", "kernels", "llguidance", "mistral-common", "modelscope", "ninja", "numba",
    "nvidia-cutlass-dsl", "nvidia-mathdx", "nvidia-ml-py", "nvshmem4py-cu13", "outlines", "py-spy", "quack-kernels",
    "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "smg-grpc-servicer", "tilelang", "timm",
    "tml-renderers", "torch-memory-saver", "torchaudio", "torchcodec",
}  # fmt: skip


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    import sglang
    import torch

    import stitchboard.sidecar.engines.sglang.loader  # noqa: F401  (the loader's imports resolve here)

    problems = []
    if not torch.__version__.startswith("2.14.1"):
        problems.append(f"torch is {torch.__version__}, not 2.14.1")
    if sglang.__version__ != "0.5.23":
        problems.append(f"sglang is {sglang.__version__}, not 0.5.23")
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        m = re.match(r"sglang 0\.5\.23 requires ([A-Za-z0-9_.\-]+)", line)
        if not (m and _norm(m.group(1)) in LEFT_OUT and line.endswith("which is not installed.")):
            problems.append(f"pip check: {line}")
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(
            f"SGLang environment ok: torch {torch.__version__}, sglang {sglang.__version__}; "
            f"pip check lists only the {len(LEFT_OUT)} requirements left out on purpose"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
