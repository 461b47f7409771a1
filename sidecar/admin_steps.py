"""prime-rl's training steps as versions (sidecar process, event loop): the step a folder path names, and the
first version of the run recording that step, asked of the bulletin (``GET /v1/runs/{run}/versions?step=N``).

Shared by prime-rl's admin routes: ``/update_weights`` (:mod:`.admin_prime_rl`) and the LoRA routes
(:mod:`.admin_prime_rl_lora`). The lookups run on threads of their own (:data:`ADMIN_LOOKUP_THREADS`), so
any number of waits never holds the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.errors import StitchError
from stitchboard.proto.schema import VersionInfo

from .errors import InvalidAdminRequestError
from .gate import Gate
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")

#: How often ``/update_weights`` looks at the applied version while it waits, seconds.
APPLIED_POLL_S = 0.05
#: The largest step the bulletin looks up (its ``step`` query is below 2**63).
MAX_STEP = 2**63 - 1
#: Threads of the ``/update_weights`` step lookups at the bulletin (blocking client calls), shared by every wait of
#: the process: the waits queue here, never in the event loop's default executor.
ADMIN_LOOKUP_THREADS = 2
_LOOKUPS = ThreadPoolExecutor(max_workers=ADMIN_LOOKUP_THREADS, thread_name_prefix="stitch-admin")
_STEP_DIR = re.compile(r"step_([0-9]+)")  # ASCII digits only (\d and int() take any script's)
#: What a weight_dir looks like (the error messages quote it).
EXPECTED_WEIGHT_DIR = '{"weight_dir": "<output_dir>/broadcasts/step_N"} (or .../checkpoints/step_N/weight)'


def step_of_weight_dir(weight_dir: Any, field: str = "weight_dir") -> int:
    """The training step N of prime-rl's ``weight_dir`` (or a LoRA route's ``lora_path``: ``field``): its last
    folder ``step_N``, or ``step_N/weight``.

    Raises:
        InvalidAdminRequestError: not a string, or no ``step_N`` folder where one is expected (naming ``field``).
    """
    if not isinstance(weight_dir, str) or not weight_dir.strip():
        why = (
            'is null (prime-rl sends none for its nixl broadcast: use weight_broadcast.type = "filesystem" and '
            "`stitchboard watch --layout prime-rl`)"
            if weight_dir is None
            else f"must be a folder path, got {weight_dir!r:.80}"
        )
        raise InvalidAdminRequestError(f"{field} {why}; expected {EXPECTED_WEIGHT_DIR}", field=field, value=weight_dir)
    path = PurePosixPath(weight_dir.strip().rstrip("/"))
    name = path.parent.name if path.name == "weight" else path.name
    match = _STEP_DIR.fullmatch(name)
    if match is None or int(match.group(1)) > MAX_STEP:
        raise InvalidAdminRequestError(
            f"{field} {weight_dir!r:.200} names no training step: its last folder must be step_N (N an integer "
            f">= 0 below 2**63); expected {EXPECTED_WEIGHT_DIR}",
            field=field,
            value=weight_dir[:200],
        )
    return int(match.group(1))


async def _lookup(deadline: float, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` on the admin's lookup threads, awaited until the event loop's ``deadline``.

    Raises:
        TimeoutError: no answer by the deadline (a call still queued is dropped).
    """
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(asyncio.wrap_future(_LOOKUPS.submit(call, *args)), max(0.0, deadline - loop.time()))


async def version_of_step(
    client: BulletinClient, settings: SidecarSettings, gate: Gate, step: int, deadline: float
) -> tuple[VersionInfo | None, str | None]:
    """The first version at ``step`` or later, asked of the bulletin again each time the gate's target or applied
    version moves (the reconciler follows the bulletin's latest), at least every ``poll_wait_s`` (after an error,
    ``retry_backoff_s``), until the event loop's ``deadline``; ``(None, why)`` when none came in time."""
    loop = asyncio.get_running_loop()
    problem = None
    while True:
        known, pause_s = (gate.target, gate.applied), settings.poll_wait_s
        try:
            info = await _lookup(deadline, client.version_for_step, settings.run, step)
            if info is not None:
                return info, None
        except TimeoutError:
            return None, problem or "the bulletin did not answer the step lookup in time"
        except StitchError as exc:  # the bulletin unreachable or answering oddly: asked again until the deadline
            problem, pause_s = f"the bulletin's last answer: {exc.type}: {exc}", settings.retry_backoff_s
            log.warning("prime-rl: looking up step %d of run %r: %s", step, settings.run, problem)
        until = min(deadline, loop.time() + pause_s)
        while (gate.target, gate.applied) == known and loop.time() < until:
            await asyncio.sleep(min(APPLIED_POLL_S, until - loop.time()))
        if loop.time() >= deadline:
            return None, problem
