"""The prefix cache salted by version, instead of reset at every commit (sidecar process).

With the ``salt_cache`` setting (``--salt-cache``; off by default, see docs/benchmarks.md),
every request the proxy admits to a salted route (the engine kind's ``salted_paths``,
:mod:`.engines.registry`) gets the body field ``cache_salt`` (the kind's ``salt_field``) =
``stitch-v<version it is admitted under>`` (a client's own salt is kept in front:
``<salt>|stitch-v<N>``; a list of salts, one per prompt of a batch, is salted item by item):

* vLLM: ``/v1/completions`` and ``/v1/chat/completions``. vLLM mixes the salt into the hash of
  the first cached block; the engine is paused with ``clear_cache=false`` (vLLM's plain pause
  resets the cache itself) and not reset after the write.
* SGLang (0.5.23): ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``. Its radix
  cache keys every node on ``(extra_key, cache_salt, tokens)``, so prefixes of different salts
  never share a node; the commit's retract pause leaves the radix cache as it is, and the
  ``/flush_cache`` after the write is skipped.

So a request reuses only KV computed for requests admitted under the same version. The reset is
still made when it is the only way to keep KV of other weights out of use:

* requests admitted under the old version are still in flight at the commit (the gate's
  ``in_flight``): their cached or computed KV carries the old salt and they run on under the new
  weights (vLLM preempts and recomputes them at its reset; SGLang's retracted requests would
  match their own old-salt prefixes again unless the cache is flushed);
* a request without a salt (another route, a body the sidecar cannot salt) was admitted since
  the last reset: its KV is reachable from any version.
"""

from __future__ import annotations

from typing import Any

from .engines.registry import lookup


def _salted(own: str | None, version: int) -> str:
    return f"{own}|stitch-v{version}" if own else f"stitch-v{version}"


class CacheSalter:
    """Salts admitted requests and says when a commit must still reset the cache (event-loop only).

    Args:
        enabled: the ``salt_cache`` setting.
        engine: the engine kind (its descriptor's ``salted_paths``; a kind without any is never salted).

    Raises:
        ValueError: an engine kind that is neither built in nor registered.
    """

    def __init__(self, enabled: bool, engine: str) -> None:
        kind = lookup(engine)
        self.paths, self.field = kind.salted_paths, kind.salt_field
        self.enabled = enabled and bool(self.paths)
        self.unsalted_since_reset = False

    def salt(self, path: str, payload: Any, version: int) -> bool:
        """Add the salt of ``version`` to a request body (a decoded dict, changed in place); returns
        whether it did. A model request it cannot salt is remembered (the next commit resets)."""
        if not self.enabled:
            return False
        own = payload.get(self.field) if isinstance(payload, dict) else None
        if (
            path not in self.paths
            or not isinstance(payload, dict)
            or not (
                own is None or isinstance(own, str) or (isinstance(own, list) and all(isinstance(s, str) for s in own))
            )
        ):
            self.unsalted_since_reset = True
            return False
        payload[self.field] = [_salted(s, version) for s in own] if isinstance(own, list) else _salted(own, version)
        return True

    def needs_reset(self, in_flight: int) -> bool:
        """Whether a commit must reset the prefix cache (always, unless salting; see the module docstring)."""
        return not self.enabled or in_flight > 0 or self.unsalted_since_reset

    def was_reset(self) -> None:
        """Record that the prefix cache was reset."""
        self.unsalted_since_reset = False
