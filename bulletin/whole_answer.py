"""A fixed HTTP answer sent whole to many requests, and the scope extension that sends it (bulletin process).

The long-poll fan-out (:mod:`.longpoll`) answers thousands of waiting requests with the same
bytes. Where the server offers it (the bulletin's uvicorn protocol, :mod:`.http_protocol`), a
request's scope holds under :data:`WHOLE_ANSWER` a callable that writes a :class:`WholeAnswer`
at once and completes the request as the server's own ``send`` would, returning False (nothing
written) where the answer must go through the ASGI ``send`` instead. This module imports no
server, so the app runs under any ASGI server (which then offers no such send).
"""

from __future__ import annotations

from http import HTTPStatus

#: The ASGI scope extension (``scope["extensions"][WHOLE_ANSWER]``) holding the request's whole-answer send.
WHOLE_ANSWER = "stitchboard.whole_answer"


class WholeAnswer:
    """A fixed answer (status, headers, body), its bytes on the wire built once for every request of
    a server: they only differ when the server's default headers do (uvicorn's ``date`` changes
    each second).

    Args:
        status: the HTTP status code.
        headers: ``(name, value)`` pairs with lower-case names, as in an ASGI
            ``http.response.start`` message; they hold the body's ``content-length``.
        body: the body bytes.
    """

    __slots__ = ("_bytes", "_defaults", "body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body
        self._defaults: list[tuple[bytes, bytes]] | None = None
        self._bytes = b""

    def wire(self, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        """The answer as HTTP/1.1 bytes: status line, ``default_headers`` then :attr:`headers`, blank line, body
        (uvicorn writes an answer's start and body messages the same way)."""
        if default_headers is not self._defaults:
            status = b"HTTP/1.1 %d %s\r\n" % (self.status, HTTPStatus(self.status).phrase.encode())
            lines = [b"%s: %s\r\n" % pair for pair in [*default_headers, *self.headers]]
            self._bytes, self._defaults = b"".join([status, *lines, b"\r\n", self.body]), default_headers
        return self._bytes
