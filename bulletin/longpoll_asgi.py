"""The long-poll's fast path: ``GET /v1/runs/{run}/versions/latest`` answered by a pure ASGI layer.

Thousands of sidecars wait on this route at once and are all answered within one publish, so
each answer's cost is what the fan-out takes (``tests/benchmarks/bench_bulletin.py``). A
well-formed request whose token may read the run is served here, without the framework's
routing, dependency solving and response wrappers: it waits on the :class:`~.longpoll.Watcher`,
which sends the answer built once for all waiters in one pass when the version is noted (whole,
where the server offers it: :mod:`.whole_answer`). Anything else (a bad run id or query value, a
refused token, another route) passes to the app unchanged, whose route
(:func:`~.routes_versions.latest`) answers it and documents the API; both give the same answers.
The middleware sits outside the app's latency middleware (an answer sent whole passes no ASGI
message through it) and records the requests it answers in the same histogram. A waiter whose
client hangs up ends at once, answering nothing (recorded as status 499; :mod:`.hangup`).
"""

from __future__ import annotations

import logging
import math
import re
import time
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .cache_headers import NO_STORE
from .deps import BulletinState
from .errors import BulletinError
from .hangup import Hangup
from .ledger import run_key
from .longpoll import DirectWaiter

log = logging.getLogger("stitchboard.bulletin")

#: The route's path template (as the app's route declares it).
LATEST_ROUTE = "/v1/runs/{run}/versions/latest"
_PATH = re.compile(r"^/v1/runs/([^/]+)/versions/latest$")
_NO_CONTENT = Response(status_code=204, headers={"cache-control": NO_STORE})
#: The status recorded for a long-poll whose client hung up (nothing is sent).
CLIENT_GONE = 499


def _query(raw: bytes) -> tuple[int, float] | None:
    """``(after, wait_s)`` of a query string the route would accept as they are; None for anything else."""
    try:
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, strict_parsing=bool(raw))
    except ValueError:
        return None
    values = dict(pairs)
    if len(values) != len(pairs) or not set(values) <= {"after", "wait_s"}:
        return None
    try:
        after, wait_s = int(values.get("after", "-1")), float(values.get("wait_s", "0"))
    except ValueError:
        return None
    if after < -1 or not (math.isfinite(wait_s) and wait_s >= 0):
        return None
    return after, wait_s


def _authorization(scope: Scope) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class LongPollFastPath:
    """ASGI middleware serving well-formed, allowed long-polls of the latest version (see the module docstring).

    Args:
        app: the rest of the app.
        state: the bulletin's state (watcher, auth, settings).
    """

    def __init__(self, app: ASGIApp, state: BulletinState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "GET" else None
        args = _query(scope["query_string"]) if match else None
        if match is None or args is None:
            await self.app(scope, receive, send)
            return
        run, (after, wait_s) = match.group(1), args
        try:
            run_key(run)
            self.state.auth.check(_authorization(scope), "read", run)
        except BulletinError:
            await self.app(scope, receive, send)  # the route answers the refusal
            return
        start, status = time.perf_counter(), 500
        try:
            status = await self._answer(scope, receive, send, run, after, wait_s)
        finally:  # what the app's LatencyMiddleware, inside this one, records for the requests it sees
            self.state.metrics.request_seconds.labels("GET", LATEST_ROUTE, str(status)).observe(
                time.perf_counter() - start
            )

    async def _answer(self, scope: Scope, receive: Receive, send: Send, run: str, after: int, wait_s: float) -> int:
        """Wait for a version of ``run`` newer than ``after`` and answer; returns the answer's status."""
        watcher, waiter = self.state.watcher, DirectWaiter(scope, receive, send, after)
        watcher.register(run, waiter)  # a version noted while waiting is sent by the watcher's fan-out
        failure: Response | None = None
        hangup = Hangup(scope, receive)
        try:
            with hangup:
                info = await watcher.wait(run, after, min(wait_s, self.state.settings.max_wait_s), hangup)
        except BulletinError as exc:
            failure = JSONResponse(exc.body(), status_code=exc.status)
        except Exception as exc:  # the app's catch-all answer, as for any route
            log.exception("unhandled error on GET %s", scope["path"])
            failure = JSONResponse(
                {"type": "InternalError", "message": f"internal error ({type(exc).__name__}); see the bulletin log"},
                status_code=500,
            )
        finally:
            watcher.unregister(run, waiter)
        if waiter.claimed and waiter.sent is not None:
            await waiter.sent
            return 200
        if hangup.gone:
            return CLIENT_GONE
        if failure is not None:
            await failure(scope, receive, send)
            return failure.status_code
        answer = _NO_CONTENT if info is None else watcher.answer(run)
        await answer(scope, receive, send)
        return answer.status_code
