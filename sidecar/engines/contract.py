"""The sidecar<->engine contracts, declared once (imported by the sidecar and inside engine processes).

Nothing here imports the sidecar service: the vLLM worker extension and the SGLang loader import
this module inside the engine's own processes.

* Request marks: the sidecar puts a mark into the ``X-Request-Id`` (or SGLang's
  ``custom_params``) of the requests it wants the engine to report on; the engine code finds it
  with the patterns below. :func:`new_mark` (per-token output counts, :mod:`..spans`) and
  :func:`new_routing_mark` (routing replay, :mod:`..routed_experts`) make them.
* Fault injection (crash tests only): :data:`FAULT_ENV` names the write phase at which the engine
  process exits with :data:`FAULT_EXIT_CODE`; :data:`FAULT_VERSION_ENV` limits it to the apply or
  load to that version.
"""

from __future__ import annotations

import re
import uuid

#: The mark of a request whose output-token counts the sidecar reads at a commit (``stitch-`` + 32 hex).
MARK = re.compile(r"stitch-[0-9a-f]{32}")
#: The ``custom_params`` key holding the mark of an SGLang request with several outputs.
MARK_PARAM = "stitch_spans_mark"
#: The mark of a request whose routed experts the sidecar collects (``stitch-routing-`` + 32 hex).
ROUTE_MARK = re.compile(r"stitch-routing-[0-9a-f]{32}")

#: Environment variable naming the phase at which to kill the engine process (crash tests).
FAULT_ENV = "STITCH_ENGINE_FAULT_PHASE"
#: Environment variable restricting the fault to an apply or load to this version (crash tests).
FAULT_VERSION_ENV = "STITCH_ENGINE_FAULT_VERSION"
#: The phases :data:`FAULT_ENV` may name.
FAULT_PHASES = ("staged", "half-written", "written-unverified")
#: Exit status of a fault-injected exit.
FAULT_EXIT_CODE = 86


def new_mark() -> str:
    """A fresh :data:`MARK` (``stitch-<32 hex>``)."""
    return f"stitch-{uuid.uuid4().hex}"


def new_routing_mark() -> str:
    """A fresh :data:`ROUTE_MARK` (``stitch-routing-<32 hex>``)."""
    return f"stitch-routing-{uuid.uuid4().hex}"
