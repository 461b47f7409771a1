"""Engine adapters (run in the sidecar) and the code each engine runs inside its own processes.

One folder per engine kind. Which process runs each module is in DESIGN.md's map ("Packages and
modules"), the one list of them. Nothing here is imported at package import: the worker processes
import only what they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings import SidecarSettings
    from .base import EngineAdapter


def create_adapter(settings: SidecarSettings) -> EngineAdapter:
    """The adapter for ``settings.engine`` at ``settings.engine_url``, with the settings' timeouts.

    Raises:
        ValueError: an engine kind this sidecar has no adapter for.
    """
    if settings.engine == "vllm":
        from .vllm.adapter import VllmEngine

        return VllmEngine(
            settings.engine_url,
            timeout_s=settings.engine_call_timeout_s,
            apply_timeout_s=settings.engine_apply_timeout_s,
        )
    if settings.engine == "sglang":
        from pathlib import Path

        from .sglang.adapter import SglangEngine

        records = Path(settings.handoff_dir) / f"sidecar-{settings.port}" / "sglang-records"
        return SglangEngine(
            settings.engine_url,
            records,
            timeout_s=settings.engine_call_timeout_s,
            apply_timeout_s=settings.engine_apply_timeout_s,
        )
    raise ValueError(f"no engine adapter for engine {settings.engine!r}: use one of 'vllm', 'sglang'")
