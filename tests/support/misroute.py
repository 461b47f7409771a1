"""A misrouting ingress in front of a bulletin: forwards every request, and while ``misroute`` is
on, sends one run's requests to another run (as a wrong ingress rule or a proxy keyed on the wrong
path would). Served on loopback with :class:`~tests.support.app_server.AppServer`; the answers are
the real bulletin's, for the other run.
"""

from __future__ import annotations

import httpx
from starlette.requests import Request
from starlette.responses import Response


class MisrouteProxy:
    """An ASGI app forwarding to ``upstream``; ``misroute = (run, other)`` rewrites ``/v1/runs/{run}/``
    to ``/v1/runs/{other}/`` (None: forwards as it is).

    Attributes:
        misroute: the rewrite in force, or None.
        rewritten: how many requests were sent to the other run.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.misroute: tuple[str, str] | None = None
        self.rewritten = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path = request.url.path
        if self.misroute is not None and path.startswith(f"/v1/runs/{self.misroute[0]}/"):
            path = f"/v1/runs/{self.misroute[1]}/" + path[len(f"/v1/runs/{self.misroute[0]}/") :]
            self.rewritten += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.request(
                request.method,
                self.upstream + path,
                params=request.query_params,
                content=await request.body(),
                headers=headers,
            )
        drop = ("content-length", "transfer-encoding", "connection", "content-encoding")
        out = {k: v for k, v in answer.headers.items() if k.lower() not in drop}
        await Response(answer.content, status_code=answer.status_code, headers=out)(scope, receive, send)
