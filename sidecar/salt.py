"""The prefix cache salted by version, instead of reset at every commit (sidecar process).

With the ``salt_cache`` setting (``--salt-cache``; off by default, see the README's figures),
every request the proxy admits to vLLM's ``/v1/completions`` or ``/v1/chat/completions`` gets
the body field ``cache_salt`` = ``stitch-v<version it is admitted under>`` (a client's own salt
is kept in front: ``<salt>|stitch-v<N>``). vLLM mixes the salt into the hash of the first
cached block, so a request reuses only KV computed for requests admitted under the same
version, and the prefix cache need not be reset at a commit: the engine is paused with
``clear_cache=false`` (vLLM's plain pause resets the cache itself) and not reset after the write.

The reset is still made when it is the only way to keep KV of other weights out of use:

* requests admitted under the old version are still in flight at the commit (the gate's
  ``in_flight``): their cached or computed KV carries the old salt and they run on under the new
  weights, so vLLM's reset (running requests preempted and recomputed) is needed;
* a request without a salt (another route, or another engine kind) was admitted since the last
  reset: its blocks are reachable from any version.

SGLang 0.5.23 has the same namespace (``extra_key`` on ``/generate`` and its OpenAI routes), but
the sidecar does not salt it yet: SGLang keeps its flush at every commit.
"""

from __future__ import annotations

from typing import Any

SALT_FIELD = "cache_salt"
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class CacheSalter:
    """Salts admitted requests and says when a commit must still reset the cache (event-loop only).

    Args:
        enabled: the ``salt_cache`` setting.
        engine: the engine kind (only ``vllm`` is salted).
    """

    def __init__(self, enabled: bool, engine: str) -> None:
        self.enabled = enabled and engine == "vllm"
        self.unsalted_since_reset = False

    def salt(self, path: str, payload: Any, version: int) -> bool:
        """Add the salt of ``version`` to a request body (a decoded dict, changed in place); returns
        whether it did. A model request it cannot salt is remembered (the next commit resets)."""
        if not self.enabled:
            return False
        if path not in SALTED_PATHS or not isinstance(payload, dict) or not isinstance(payload.get(SALT_FIELD, ""), str):
            self.unsalted_since_reset = True
            return False
        own = payload.get(SALT_FIELD)
        payload[SALT_FIELD] = f"{own}|stitch-v{version}" if own else f"stitch-v{version}"
        return True

    def needs_reset(self, in_flight: int) -> bool:
        """Whether a commit must reset the prefix cache (always, unless salting; see the module docstring)."""
        return not self.enabled or in_flight > 0 or self.unsalted_since_reset

    def was_reset(self) -> None:
        """Record that the prefix cache was reset."""
        self.unsalted_since_reset = False
