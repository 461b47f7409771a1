"""The trainer SDK: publish the weights a trainer holds as versions of a bulletin run.

What a training loop imports::

    from stitchboard.trainer_client import Publisher, PublishError

Names load on first use: importing the package stays cheap (no torch, ~4 s on a small CPU),
since every ``stitchboard`` command imports it for ``publish``/``pull``. The function
``served_view`` is not among them: its name is its module's, which would replace it here once
imported; take it from :mod:`stitchboard.trainer_client.served_view`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter_pull import pull_adapter
    from .errors import (
        AdapterRefusedError,
        AssetsError,
        CheckpointNameError,
        FleetTimeoutError,
        PublisherClosedError,
        PublishError,
        ResumeError,
        ServedViewError,
        TrainerError,
    )
    from .fleet import FleetPacing, wait_for_fleet
    from .publish_result import PublishResult
    from .publisher import Publisher
    from .resume import RebuiltVersion, pull_version, rebuild_version
    from .served_view import DtypeMap, checkpoint_name, checkpoint_state, from_raw, to_raw
    from .sharded import ShardedPublisher

#: Exported name -> the submodule defining it.
_SOURCES = {
    "Publisher": "publisher",
    "ShardedPublisher": "sharded",
    "PublishResult": "publish_result",
    "checkpoint_name": "served_view",
    "checkpoint_state": "served_view",
    "to_raw": "served_view",
    "from_raw": "served_view",
    "DtypeMap": "served_view",
    "rebuild_version": "resume",
    "pull_version": "resume",
    "RebuiltVersion": "resume",
    "pull_adapter": "adapter_pull",
    "AdapterRefusedError": "errors",
    "TrainerError": "errors",
    "ServedViewError": "errors",
    "CheckpointNameError": "errors",
    "PublishError": "errors",
    "PublisherClosedError": "errors",
    "ResumeError": "errors",
    "AssetsError": "errors",
    "FleetTimeoutError": "errors",
    "FleetPacing": "fleet",
    "wait_for_fleet": "fleet",
}

__all__ = [
    "AdapterRefusedError",
    "AssetsError",
    "CheckpointNameError",
    "DtypeMap",
    "FleetPacing",
    "FleetTimeoutError",
    "PublishError",
    "PublishResult",
    "Publisher",
    "PublisherClosedError",
    "RebuiltVersion",
    "ResumeError",
    "ServedViewError",
    "ShardedPublisher",
    "TrainerError",
    "checkpoint_name",
    "checkpoint_state",
    "from_raw",
    "pull_adapter",
    "pull_version",
    "rebuild_version",
    "to_raw",
    "wait_for_fleet",
]


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` and return it (then cached in this module).

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`.
    """
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}; its public names are {', '.join(__all__)}"
        )
    value = getattr(import_module(f"{__name__}.{source}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
