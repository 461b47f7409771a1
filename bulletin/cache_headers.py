"""``Cache-Control`` on every bulletin answer, so any HTTP cache or CDN in front of it keeps only what it may.

Runs in the bulletin process. Two kinds of answer (RFC 9111):

- **Immutable objects**: a blob (``/v1/runs/{run}/blobs/{sha256}``: patch containers, anchors,
  squash blobs, all named by their sha256) and a committed version's manifest
  (``/v1/runs/{run}/versions/{version}``) never change once stored, so their 200, 206 and 304
  answers say ``max-age=31536000, immutable`` (a year: the longest value RFC 9111 §5.2.2.1 asks
  caches to honour, rounded down). ``public`` is added only on an open bulletin (no tokens, so
  nothing to withhold); with tokens it is left out, and a shared cache must then not store an
  answer to a request that carried ``Authorization`` (RFC 9111 §3.5) unless it is configured to,
  behind its own check of the caller.
- **Everything else** (the latest pointer and its long-poll, version lists, plans, squash lists,
  the fleet, the status page, errors, a 307 to a presigned URL, whose URL expires): ``no-store``,
  added by :class:`DefaultNoStore` to any answer that names no policy of its own. Without it a
  cache could keep a 404 for a blob not yet uploaded, or a stale ``latest``, by heuristic
  freshness (RFC 9111 §4.2.2).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The policy of every answer that is not an immutable object's (RFC 9111 §5.2.2.5).
NO_STORE = "no-store"
#: Seconds an immutable object may be kept (one year, RFC 9111 §5.2.2.1's suggested ceiling).
IMMUTABLE_MAX_AGE_S = 31_536_000

_HEADER = b"cache-control"
_NO_STORE = (_HEADER, NO_STORE.encode())


def immutable(open_bulletin: bool) -> str:
    """The ``Cache-Control`` value of an immutable object's answer (a blob, a committed manifest).

    Args:
        open_bulletin: True when the bulletin has no tokens (anyone may read): the answer is ``public``.

    Returns:
        ``"public, max-age=31536000, immutable"`` on an open bulletin, else ``"max-age=31536000, immutable"``.
    """
    policy = f"max-age={IMMUTABLE_MAX_AGE_S}, immutable"
    return f"public, {policy}" if open_bulletin else policy


class DefaultNoStore:
    """ASGI middleware: adds ``Cache-Control: no-store`` to every HTTP answer that names no policy of its own.

    It wraps ``send`` only (no body is read or copied); answers sent whole past the ASGI layer
    (:mod:`.whole_answer`) carry their own header (:class:`~.longpoll.SharedAnswer`).

    Args:
        app: the rest of the app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                if not any(name.lower() == _HEADER for name, _ in headers):
                    message["headers"] = [*headers, _NO_STORE]
            await send(message)

        await self.app(scope, receive, send_with_policy)
