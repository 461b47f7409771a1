"""A fault-injecting HTTP/1.1 proxy on loopback, for tests of what crosses a network (e.g. bulletin -> S3).

:class:`FaultProxy` runs an asyncio server in a thread of its own and forwards each request to
``target``, one upstream connection per client connection (keep-alive is kept; the proxy
answers ``Expect: 100-continue`` itself and reads each body whole before forwarding it). Per-request
:class:`Rule` objects, matched in order on method and path, inject faults:

* ``status``: answer with that status and an S3-style XML error body, without forwarding;
* ``drop``: close the connection after reading the request, answering nothing;
* ``cut``: forward, then cut the answer after ``cut_after_bytes`` bytes;
* ``corrupt``: flip one byte in the middle of the request body before forwarding;
* ``corrupt_answer``: flip one byte in the middle of the answer body;
* ``delay``: wait ``delay_s`` seconds, then forward.

With ``check_digests`` (default) the proxy does what S3 does and moto does not: a request whose
body does not hash to its ``x-amz-checksum-sha256`` header is answered ``400 BadDigest`` and
not forwarded. Every request is logged in :attr:`FaultProxy.log` as ``(method, path, action)``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import re
import threading
from dataclasses import dataclass
from urllib.parse import urlparse

from stitchboard.demo.processes import free_socket

_NO_BODY_STATUS = {204, 304}


@dataclass
class Rule:
    """One fault: ``action`` for requests matching ``method`` (None: any) and the regex ``path`` (searched),
    ``times`` times (None: always)."""

    action: str
    path: str = ""
    method: str | None = None
    times: int | None = 1
    status: int = 503
    code: str = "SlowDown"
    delay_s: float = 0.0
    cut_after_bytes: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            (self.times is None or self.times > 0)
            and (self.method is None or self.method == method)
            and re.search(self.path, path) is not None
        )


def _flip(body: bytes) -> bytes:
    if not body:
        return body
    i = len(body) // 2
    return body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1 :]


def _error_answer(status: int, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
    ).encode()
    head = f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    return head + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return head, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], until_eof: bool) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            out += size_line
            size = int(size_line.split(b";")[0], 16)
            out += await reader.readexactly(size + 2)
            if size == 0:
                return bytes(out)
    return await reader.read() if until_eof else b""


class FaultProxy:
    """An HTTP proxy on a free loopback port (``self.url``) in front of ``target``; see the module docstring.

    Args:
        target: ``http://host:port`` to forward to.
        rules: faults to inject, matched in order (add more with :meth:`add`).
        check_digests: answer ``400 BadDigest`` to bodies that do not match their ``x-amz-checksum-sha256``.
    """

    def __init__(self, target: str, rules: list[Rule] | None = None, *, check_digests: bool = True) -> None:
        parsed = urlparse(target)
        self._target = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rules = list(rules or [])
        self.check_digests = check_digests
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        sock = free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(sock, started), daemon=True)
        self._thread.start()
        started.wait(10)

    def add(self, rule: Rule) -> None:
        """Add a rule (after the existing ones)."""
        with self._lock:
            self.rules.append(rule)

    def actions(self, action: str) -> int:
        """How many requests got ``action`` so far."""
        with self._lock:
            return sum(1 for entry in self.log if entry[2] == action)

    def _pick(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule
        return None

    def _serve(self, sock, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._connection, sock=sock))
        started.set()
        try:
            self._loop.run_forever()
        finally:  # stopped: end the open connections (their writers close) and close the loop
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while (request := await _read_head(reader)) is not None:
                head, headers = request
                method, path = head.split(b" ", 2)[:2]
                if (
                    headers.get("expect", "").lower() == "100-continue"
                ):  # answer it here; upstream gets the whole request
                    head = re.sub(rb"(?im)^expect:[^\r\n]*\r\n", b"", head)
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await _read_body(reader, headers, until_eof=False)
                if upstream is None:
                    upstream = await asyncio.open_connection(*self._target)
                if not await self._one(method.decode(), path.decode(), head, headers, body, writer, upstream):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _one(
        self,
        method: str,
        path: str,
        head: bytes,
        headers: dict[str, str],
        body: bytes,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> bool:
        """Handle one request; False when the connection must be closed."""
        rule = self._pick(method, path)
        action = rule.action if rule else "forward"
        if rule and rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
        if rule and rule.action == "corrupt":
            body = _flip(body)
        with self._lock:
            self.log.append((method, path, action))
        if rule and rule.action == "drop":
            return False
        if rule and rule.action == "status":
            writer.write(_error_answer(rule.status, rule.code, "injected by FaultProxy"))
            await writer.drain()
            return True
        claimed = headers.get("x-amz-checksum-sha256")
        if self.check_digests and claimed and base64.b64encode(hashlib.sha256(body).digest()).decode() != claimed:
            with self._lock:
                self.log.append((method, path, "bad_digest"))
            writer.write(
                _error_answer(400, "BadDigest", "The SHA256 you specified did not match the calculated checksum.")
            )
            await writer.drain()
            return True
        up_reader, up_writer = upstream
        up_writer.write(head + body)
        await up_writer.drain()
        status = 100
        while 100 <= status < 200:  # interim answers are not forwarded
            answer = await _read_head(up_reader)
            if answer is None:
                return False
            answer_head, answer_headers = answer
            status = int(answer_head.split(b" ", 2)[1])
        closes = answer_headers.get("connection", "").lower() == "close"
        answer_body = (
            b""
            if method == "HEAD" or status in _NO_BODY_STATUS
            else await _read_body(up_reader, answer_headers, until_eof=True)
        )
        if rule and rule.action == "corrupt_answer":
            answer_body = _flip(answer_body)
        data = answer_head + answer_body
        if rule and rule.action == "cut":
            writer.write(data[: len(answer_head) + rule.cut_after_bytes])
            await writer.drain()
            return False
        writer.write(data)
        await writer.drain()
        return not closes

    def stop(self) -> None:
        """Stop the proxy and its thread."""

        async def close() -> None:
            self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
