"""The thread pools the sidecar's loop runs its blocking calls in (sidecar process).

Bulletin calls (long-polls, fetches, local file work) and engine calls run in pools of their own:
an engine call that blocks never holds up the long-poll or a fetch, nor the reverse. Each pool
has one worker more than the loop uses at once: a call dropped by a reboot keeps its thread
until it ends. Both calls are typed with a ParamSpec, so mypy checks each call's arguments
against the function it runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Pools:
    """The bulletin pool (3 threads) and the engine pool (2 threads) of one sidecar's loop."""

    def __init__(self) -> None:
        self._bulletin = ThreadPoolExecutor(max_workers=3, thread_name_prefix="stitch-bulletin")
        self._engine = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stitch-engine")

    async def io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking bulletin call (or local file work) in the bulletin pool; its answer (or its error)."""
        return await asyncio.get_running_loop().run_in_executor(self._bulletin, functools.partial(fn, *args, **kwargs))

    async def engine(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking engine-adapter call in the engine pool; its answer (or its error)."""
        return await asyncio.get_running_loop().run_in_executor(self._engine, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop both pools; a running call finishes in the background, queued ones are dropped."""
        self._bulletin.shutdown(wait=False, cancel_futures=True)
        self._engine.shutdown(wait=False, cancel_futures=True)
