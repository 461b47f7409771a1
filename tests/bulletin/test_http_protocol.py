"""bulletin/http_protocol.py: an answer's writes of one event-loop pass go out as one, and HTTP still works.

The unit part drives :class:`CoalescingTransport` over a recording transport on a real event
loop; the served part runs uvicorn with :class:`CoalescingHttpToolsProtocol` on loopback and
counts the real transport's writes per answer (one, where uvicorn alone makes two), with
keep-alive, HEAD and a streamed body answered as before; an answer sent whole (the scope
extension the protocol offers) is the same bytes as the ASGI one, and is refused where it cannot
be sent that way.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from stitchboard.bulletin.http_protocol import JOIN_MAX_BYTES, CoalescingHttpToolsProtocol, CoalescingTransport
from stitchboard.bulletin.whole_answer import WHOLE_ANSWER, WholeAnswer


class Recording:
    """A transport that records what is done to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 7

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append(("eof", b""))

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_a_write_goes_out_joined_to_the_next_and_a_lone_one_at_the_next_pass():
    async def scenario() -> None:
        real = Recording()
        t = CoalescingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        buffer = bytearray(b"head ")
        t.write(buffer)
        buffer[:] = b"XXXXX"  # the caller reuses its buffer: what was written stays
        assert real.calls == [] and t.get_write_buffer_size() == 7 + 5
        t.write(memoryview(b"body"))
        assert real.calls == [("write", b"head body")], "the second write did not send both at once"
        t.writelines([b"a", b"b", b"c"])
        assert real.calls[1:] == [("write", b"ab")]
        await asyncio.sleep(0)
        assert real.calls[2:] == [("write", b"c")], "a lone write was not sent at the loop's next pass"
        await asyncio.sleep(0)
        t.write(b"h")
        big = b"B" * (JOIN_MAX_BYTES + 1)
        t.write(big)
        assert real.calls[3:] == [("write", b"h"), ("write", big)], (
            "a large write was kept, or went out before what was kept"
        )
        t.write(b"last")
        t.close()
        assert real.calls[5:] == [("write", b"last"), ("close", b"")]
        await asyncio.sleep(0)
        assert len(real.calls) == 7, "a kept write was sent twice"
        assert t.get_extra_info("peername") == "info:peername"

        other = Recording()
        t = CoalescingTransport(other, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"x")
        t.abort()
        await asyncio.sleep(0)
        assert other.calls == [("abort", b"")], "an abort sent what was kept"
        gone = Recording()
        t = CoalescingTransport(gone, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"y")
        gone.closing = True
        await asyncio.sleep(0)
        assert gone.calls == [], "a write went to a closing connection"
        eof = Recording()
        t = CoalescingTransport(eof, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"z")
        t.write_eof()
        assert eof.calls == [("write", b"z"), ("eof", b"")]

    asyncio.run(scenario())


WRITES: list[int] = []


BODY = b'{"version": 3}'
ONE = WholeAnswer(200, [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())], BODY)
#: What each ``/whole`` request's whole-answer send returned.
WHOLE: list[bool] = []


async def app(scope, receive, send) -> None:
    """``/one``: a JSON answer (start + body); ``/whole``: the same answer through the whole-answer
    send, else through ASGI; ``/stream``: three body chunks, one per pass."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/whole":
        WHOLE.append(scope["extensions"][WHOLE_ANSWER](ONE))
        if WHOLE[-1]:
            return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for chunk in (b"a", b"b", b"c"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": ONE.headers})
    await send({"type": "http.response.body", "body": BODY})


class Counted:
    """A connection's transport whose writes are counted in :data:`WRITES`."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(len(data))
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


class CountingProtocol(CoalescingHttpToolsProtocol):
    """Counts the writes that reach each connection's transport."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(Counted(transport))  # type: ignore[arg-type]


@pytest.fixture
def served() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=CountingProtocol, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_each_answer_is_one_write_and_http_works_as_before(served: str):
    with httpx.Client(base_url=served) as client:
        for _ in range(3):  # keep-alive: three answers on one connection
            WRITES.clear()
            r = client.get("/one")
            assert r.status_code == 200 and r.json() == {"version": 3}
            assert len(WRITES) == 1, f"an answer took {len(WRITES)} writes"
        head = client.head("/one")
        assert head.status_code == 200 and head.headers["content-length"] == "14" and head.content == b""
        r = client.get("/stream")
        assert r.status_code == 200 and r.text == "abc"


def _raw(sock: socket.socket, request: bytes) -> bytes:
    """Send ``request`` on ``sock`` and read one answer with a content-length (or to the end)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
        data.split(b"content-length: ")[1].split(b"\r\n")[0]
    ):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _without_date(answer: bytes) -> bytes:
    return b"\r\n".join(line for line in answer.split(b"\r\n") if not line.startswith(b"date: "))


def test_an_answer_sent_whole_is_the_asgi_answer_in_one_write(served: str):
    """On one keep-alive connection: ``/whole`` sends the same bytes as ``/one`` (but the date), in one
    write, and the connection serves the next request; a request whose connection closes after its
    answer, and a HEAD request, are refused the whole send and answered through ASGI."""
    host, port = served.removeprefix("http://").split(":")
    WHOLE.clear()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        asgi = _raw(sock, b"GET /one HTTP/1.1\r\nhost: t\r\n\r\n")
        WRITES.clear()
        whole = _raw(sock, b"GET /whole HTTP/1.1\r\nhost: t\r\n\r\n")
        assert WHOLE == [True] and WRITES == [len(whole)]
        assert _without_date(whole) == _without_date(asgi) and whole.endswith(b"\r\n\r\n" + BODY)
        assert b"\r\ndate: " in whole and b"\r\nserver: uvicorn\r\n" in whole
        again = _raw(sock, b"GET /whole HTTP/1.1\r\nhost: t\r\n\r\n")  # the cycle was completed: keep-alive goes on
        assert WHOLE == [True, True] and _without_date(again) == _without_date(asgi)
        closing = _raw(sock, b"GET /whole HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        assert WHOLE[-1] is False and b"\r\nconnection: close\r\n" in closing and closing.endswith(BODY)
        assert sock.recv(100) == b"", "the connection stayed open after an answer that closes it"
    with httpx.Client(base_url=served) as client:
        head = client.head("/whole")
        assert (
            WHOLE[-1] is False
            and head.status_code == 200
            and head.headers["content-length"] == "14"
            and head.content == b""
        )
        assert client.get("/whole").json() == {"version": 3} and WHOLE[-1] is True


def test_a_request_leaves_no_reference_cycle(served: str):
    """The whole-answer send offered in each request's scope holds its cycle weakly (the cycle holds
    the scope): with the cyclic collector off, finished requests leave no cycle behind."""
    gc.collect()
    gc.disable()
    try:
        before = sum(type(o) is RequestResponseCycle for o in gc.get_objects())
        for path in ("/whole", "/one") * 20:  # a connection each
            assert httpx.get(f"{served}{path}").status_code == 200
        time.sleep(0.3)  # the server thread drops the closed connections
        left = sum(type(o) is RequestResponseCycle for o in gc.get_objects()) - before
    finally:
        gc.enable()
    assert left <= 2, f"{left} request cycles of 40 finished requests were left to the cyclic collector"


def test_uvicorn_is_within_the_range_the_protocol_was_measured_and_tested_on():
    """The protocol subclasses uvicorn's internal httptools protocol and request cycle, so the
    bulletin extra pins uvicorn to the minor release these tests ran on (kept over uvicorn's stock
    protocol by bench_bulletin: docs/bulletin.md, Long-polls). An install outside the pin fails here
    with what to do, before a served bulletin meets a changed internal."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (pin,) = [
        Requirement(r).specifier
        for r in pyproject["project"]["optional-dependencies"]["bulletin"]
        if Requirement(r).name == "uvicorn"
    ]
    assert pin.contains("0.55.0") and not pin.contains("0.56.0") and not pin.contains("0.54.0"), (
        f"the bulletin extra's uvicorn pin {pin} is wider than the release bulletin/http_protocol.py was tested on"
    )
    installed = version("uvicorn")
    assert pin.contains(installed), (
        f"uvicorn {installed} is installed, outside the bulletin's pin {pin}: bulletin/http_protocol.py subclasses "
        "its internals; install a uvicorn within the pin, or run these tests and bench_bulletin on the new release "
        "and move the pin (or serve with --http httptools)"
    )
