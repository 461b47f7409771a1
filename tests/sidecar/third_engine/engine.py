"""A third engine kind, ``third``: :class:`~tests.sidecar.fake_engine.FakeEngine`'s weights and
adapter seam behind an HTTP API of its own, registered with the sidecar through the public
:func:`stitchboard.sidecar.engines.register` (the service is not edited for it).

Its API: ``POST /infer`` ``{"input": str, "steps": int, "stream": bool}`` answers
``{"output": [token, ...]}`` (or one SSE event per token, then ``[DONE]``), each token naming a
fingerprint of the weights it was made with; ``GET /info`` is read-only; ``POST /swap`` is a
control route (the sidecar must never forward it). Nothing else is served.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from stitchboard.sidecar.engines import EngineKind, register
from stitchboard.sidecar.routes import RouteTable, post_routes
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine

#: The engines of this kind serving now, by URL (the kind's adapter factory finds its engine here).
SERVING: dict[str, ThirdEngine] = {}


class ThirdEngine(FakeEngine):
    """A :class:`FakeEngine` answering the third kind's API (serve it with :meth:`app`).

    Attributes:
        swaps: how many times its control route was called.
    """

    swaps = 0

    def close(self) -> None:
        """Nothing to close: the test stops the HTTP server (the sidecar closes an adapter it built)."""

    def app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        @app.post("/infer")
        async def infer(request: Request):
            body = await request.json()
            engine.started += 1
            steps = int(body.get("steps", 2))
            if body.get("stream"):

                async def events():
                    for i in range(steps):
                        yield f"data: {json.dumps({'token': await engine._token(i)})}\n\n"
                    yield "data: [DONE]\n\n"
                    engine.completed += 1

                return StreamingResponse(events(), media_type="text/event-stream")
            output = [await engine._token(i) for i in range(steps)]
            engine.completed += 1
            return {"output": output, "echo_body": body}

        @app.get("/info")
        async def info():
            return {"kind": "third", "tensors": len(engine.weights)}

        @app.post("/swap")
        async def swap():
            engine.swaps += 1
            return {"ok": True}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f"third_completed_total {engine.completed}\n")

        return app


def adapter(settings: SidecarSettings) -> ThirdEngine:
    """The engine of this kind serving at ``settings.engine_url`` (its seam is the adapter).

    Raises:
        KeyError: no engine of this kind serves at that URL.
    """
    return SERVING[settings.engine_url]


THIRD = EngineKind(
    name="third", routes=RouteTable(model=post_routes("/infer"), read=frozenset({("GET", "/info")})), adapter=adapter
)
register(THIRD)
