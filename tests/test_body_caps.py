"""The body rule (``bulletin/body_caps.py``) on every route of the bulletin and the sidecar, each in its own process.

Caps are set small through the settings. Every route of each app's own route table (so a route
added later is in the list) gets, without a token, a declared 1 GiB ``Content-Length`` and a
256 MiB chunked body streamed from a generator; each answer must be 413 with the service's
JSON error type, the service's process must grow by less than 16 MB (peak RSS, from
``/proc/<pid>/status``) and read at most twice the route's cap (its own count of body bytes
read per route, ``stitch_*_request_body_bytes``: the client's count is blurred by socket
buffers). Also: the sidecar's bodies in flight stay within ``body_budget_bytes``, and
``docs/reference/limits.md`` names every route that takes a body.

The client here is written by hand on a socket (h11 frames the request and parses the answer):
it keeps sending while it watches for an early answer, and stops at it, which no HTTP client
library does (they send the whole body before reading the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h11
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.body_caps import ANY_METHOD, NO_BODY, BodyBudget, BodyCaps
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.demo.processes import free_port
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import wait_for
from tests.support.pythonpath import REPO, repo_on_pythonpath

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: Every cap in these tests: above one uvicorn message (64 KiB buffered + one 256 KiB socket read),
#: so that "at most 2x the cap" leaves room for the message that passes it.
CAP = 512 * KiB
BULLETIN_CAPS = {f"STITCH_BULLETIN_{k}": str(CAP) for k in ("MAX_BLOB_BYTES", "MAX_MANIFEST_BYTES")}
BULLETIN_CAPS |= {f"STITCH_BULLETIN_{k}": str(CAP) for k in ("MAX_REPORT_BYTES", "MAX_LOGIN_BYTES")}
TOKENS = {"all-token": {"scopes": ["read", "publish", "replica", "metrics"]}, "replica-token": {"scopes": ["replica"]}}
#: With it a route reads its body (without one, a route that checks tokens answers 401 before reading any).
ALL_SCOPES = {"authorization": "Bearer all-token"}
#: Values for the path parameters of the routes (the sidecar's catch-all gets a model route).
PATH_VALUES = {"run": "caps-run", "sha256": "0" * 64, "replica_id": "rep-1", "base": "0", "target": "1"}
PATH_VALUES |= {"version": "0"}
#: The sidecar's catch-all route per method: a path it forwards (the others are refused before the body is read).
PROXIED_PATHS = {"POST": "v1/completions", "GET": "v1/models"}
CHUNK = b"\0" * (64 * KiB)
RSS_GROWTH_MAX = 16 * MiB


@dataclass
class Service:
    """One service process: its URL, pid, app (built here too, for its route table and caps) and error type."""

    url: str
    proc: subprocess.Popen
    app: object
    error_type: str
    token_headers: dict[str, str]
    body_metric: str

    def rss(self, field: str) -> int:
        """``VmRSS`` or ``VmHWM`` (peak) of the process, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KiB
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def reset_peak(self) -> None:
        """Start the peak RSS (VmHWM) again from the current RSS."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def body_bytes(self) -> dict[str, float]:
        """Body bytes read so far, per route template (the service's own counter)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.token_headers, timeout=10).text
        return {
            s.labels["route"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == self.body_metric
            for s in family.samples
            if s.name.endswith("_total")
        }

    def routes(self) -> list[tuple[str, str, str, int]]:
        """``(method, path template, a concrete path, cap in bytes)`` for every method of every route of the app's
        table."""
        caps = next(m.kwargs["caps"] for m in self.app.user_middleware if m.cls is BodyCaps)  # type: ignore[attr-defined]
        out = []
        for route in self.app.routes:  # type: ignore[attr-defined]
            for method in sorted(getattr(route, "methods", None) or ()):
                cap = caps.get((method, route.path)) or caps.get((ANY_METHOD, route.path)) or NO_BODY
                values = {**PATH_VALUES, "path": PROXIED_PATHS.get(method, "v1/completions")}
                path = re.sub(r"{(\w+)(:\w+)?}", lambda m, values=values: values[m[1]], route.path)
                out.append((method, route.path, path, cap.limit_bytes))
        return out


def _start(cmd: list[str], env: dict[str, str], url: str, health: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 180  # a loaded 2-core host can take tens of seconds to import
    while True:
        try:
            if httpx.get(f"{url}{health}", timeout=1).status_code < 500:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd} did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """The bulletin (tokens configured) and a sidecar over the fake engine, each its own process,
    caps at :data:`CAP`."""
    tmp = tmp_path_factory.mktemp("caps")
    b_port, s_port = free_port(), free_port()
    b_env = {
        **os.environ,
        **BULLETIN_CAPS,
        "STITCH_BULLETIN_STORE": f"file://{tmp / 'store'}",
        "STITCH_BULLETIN_TOKENS": json.dumps(TOKENS),
        "STITCH_BULLETIN_LOG_LEVEL": "warning",
    }
    b_cmd = [sys.executable, "-c", "from stitchboard.proto.cli import main; main()", "bulletin", "serve"]
    b_proc = _start([*b_cmd, "--port", str(b_port)], b_env, f"http://127.0.0.1:{b_port}", "/healthz")
    s_settings = {
        "STITCH_SIDECAR_BULLETIN": f"http://127.0.0.1:{b_port}",
        "STITCH_SIDECAR_RUN": "caps-run",
        "STITCH_SIDECAR_TOKEN": "replica-token",
        "STITCH_SIDECAR_REPORT": "false",
        "STITCH_SIDECAR_PORT": str(s_port),
        "STITCH_SIDECAR_HANDOFF_DIR": str(tmp / "handoff"),
        "STITCH_SIDECAR_LOG_LEVEL": "warning",
        "STITCH_SIDECAR_MAX_BODY_BYTES": str(CAP),
        "STITCH_SIDECAR_BODY_BUDGET_BYTES": str(2 * CAP),
        "STITCH_SIDECAR_BODY_BUDGET_WAIT_S": "0.5",
    }
    try:
        s_proc = _start(
            [sys.executable, "-m", "tests.sidecar.fake_sidecar_main"],
            repo_on_pythonpath({**os.environ, **s_settings}),
            f"http://127.0.0.1:{s_port}",
            "/v1/stitch/status",
        )
    except BaseException:
        _stop(b_proc)
        raise
    b_settings = BulletinSettings(
        store=f"file://{tmp / 'local'}", **{k[16:].lower(): int(v) for k, v in BULLETIN_CAPS.items()}
    )
    bulletin = Service(
        f"http://127.0.0.1:{b_port}",
        b_proc,
        create_bulletin(b_settings),
        "PayloadTooLarge",
        ALL_SCOPES,
        "stitch_bulletin_request_body_bytes",
    )
    client = BulletinClient(f"http://127.0.0.1:{b_port}")
    sidecar_app = create_sidecar(
        SidecarSettings(**{k[15:].lower(): v for k, v in s_settings.items()}),  # type: ignore[arg-type]
        engine=FakeEngine(),
        client=client,
    )
    sidecar = Service(
        f"http://127.0.0.1:{s_port}", s_proc, sidecar_app, "BodyTooLarge", {}, "stitch_sidecar_request_body_bytes"
    )
    yield bulletin, sidecar
    client.close()
    _stop(s_proc)
    _stop(b_proc)


@dataclass
class Answer:
    """An answer's status and JSON body (``{"raw": ...}`` otherwise), the body bytes sent,
    and whether it closes the connection."""

    status: int
    body: dict
    sent_bytes: int
    closes: bool


def _chunks(total: int) -> Iterator[bytes]:
    for _ in range(total // len(CHUNK)):
        yield CHUNK


class _Exchange:
    """One request on its own connection, its body sent while the answer is watched for (see :func:`send`)."""

    def __init__(self, url: str, method: str, path: str, declared: int | None, headers: dict[str, str]) -> None:
        host, port = httpx.URL(url).host, httpx.URL(url).port
        self.what, self.chunked = f"{method} {path}", declared is None
        self.conn = h11.Connection(h11.CLIENT)
        framing = ("content-length", str(declared)) if declared is not None else ("transfer-encoding", "chunked")
        fields = [("host", f"{host}:{port}"), framing, *headers.items()]
        self.pending = self.conn.send(h11.Request(method=method, target=path, headers=fields))
        self.sent, self.status, self.parts, self.closes, self.done = 0, None, [], False, False
        self.sock = socket.create_connection((host, port))
        self.sock.setblocking(False)

    def write(self, body: Iterator[bytes]) -> bool:
        """Send what the socket takes now; False once the body is all sent or the server stopped reading."""
        try:
            while True:
                if not self.pending:
                    chunk = next(body, None)
                    if chunk is None:
                        if self.chunked and self.conn.our_state is h11.SEND_BODY:  # a chunked body's last chunk
                            self.pending = self.conn.send(h11.EndOfMessage())
                            continue
                        return False
                    self.pending, self.sent = self.conn.send(h11.Data(data=chunk)), self.sent + len(chunk)
                self.pending = self.pending[self.sock.send(self.pending) :]
        except BlockingIOError:
            return True
        except (BrokenPipeError, ConnectionResetError):  # the server stopped reading: read its answer
            return False

    def read(self) -> None:
        """Take in what the socket holds; sets :attr:`done` at the answer's end or the connection's."""
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        self.conn.receive_data(data)
        while (event := self.conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(event, h11.Response):
                self.status, self.closes = event.status_code, (b"connection", b"close") in event.headers
            elif isinstance(event, h11.Data):
                self.parts.append(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self.done = True
                return
        self.done = self.done or not data

    def answer(self) -> Answer:
        self.sock.close()
        assert self.status is not None, f"{self.what}: the connection closed without an answer after {self.sent} bytes"
        raw = b"".join(self.parts)
        return Answer(
            self.status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw[:200]}, self.sent, self.closes
        )


def send(
    url: str,
    method: str,
    path: str,
    declared: int | None,
    body: Iterator[bytes],
    headers: dict[str, str] | None = None,
    timeout_s: float = 30,
) -> Answer:
    """Send ``body`` (a declared length, or chunked when ``declared`` is None) while watching for the
    answer; stop sending at the answer (or when the server stops reading). Fails when no answer
    comes within ``timeout_s``."""
    ex = _Exchange(url, method, path, declared, headers or {})
    deadline, sending = time.monotonic() + timeout_s, True
    with selectors.DefaultSelector() as selector:
        selector.register(ex.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while not ex.done:
            assert time.monotonic() < deadline, f"{ex.what}: no answer after {ex.sent} body bytes sent"
            for _, events in selector.select(0.5):
                if events & selectors.EVENT_READ:
                    ex.read()
                if sending and (ex.status is not None or (events & selectors.EVENT_WRITE and not ex.write(body))):
                    sending = False
                    selector.modify(ex.sock, selectors.EVENT_READ)
    return ex.answer()


def test_every_body_is_read_only_up_to_its_cap(services):
    """Every route of both services: a declared 1 GiB body without a token (the declared length is refused
    before the token is checked: 413) and a 256 MiB chunked one with a token, so that the route reads
    it: 413 once it passes the cap, or the route's own refusal (the sidecar's 403 for a method it
    does not forward) without a byte of it read. Every route with a cap meets it at least once."""
    for service in services:
        routes, reached = service.routes(), set()
        assert len({cap for *_, cap in routes}) == 2  # routes with a body (at CAP) and routes without
        service.reset_peak()
        rss_before, read = service.rss("VmRSS"), service.body_bytes()
        for method, template, path, cap in routes:
            for declared, body, headers in ((GiB, _chunks(GiB), {}), (None, _chunks(256 * MiB), service.token_headers)):
                what = f"{method} {template} ({'chunked 256 MiB' if declared is None else 'declared 1 GiB'})"
                answer = send(service.url, method, path, declared, body, headers)
                before, read = read, service.body_bytes()
                got = read.get(template, 0) - before.get(template, 0)
                assert answer.closes and got <= 2 * cap, f"{what}: {got} bytes read, cap {cap}; {answer}"
                if answer.status != 413 and declared is None and got == 0:
                    assert 400 <= answer.status < 500, (what, answer)  # refused before reading the body
                    continue
                assert answer.status == 413, (what, answer)
                if method != "HEAD":  # an answer to HEAD has no body
                    assert answer.body.get("type") == service.error_type, (what, answer)
                    assert answer.body["limit_bytes"] == cap, (what, answer)
                if cap and declared is None:  # the count is the server's reading: it reached the cap
                    assert got > cap, f"{what}: {got} bytes read, cap {cap}"
                    reached.add(template)
        assert reached == {template for *_, template, _, cap in routes if cap}
        growth = service.rss("VmHWM") - rss_before
        assert growth < RSS_GROWTH_MAX, f"{service.error_type}: the process grew {growth / MiB:.1f} MB"
        print(f"{service.url}: {len(routes)} route methods, peak RSS growth {growth / MiB:.2f} MB")


def test_an_answer_before_the_body_closes_the_connection(services):
    """A route that refuses the token before reading its body (401) reads none of a chunked body, and its
    answer closes the connection (the server would otherwise read the rest to throw it away)."""
    bulletin, _ = services
    before = bulletin.body_bytes()
    for method, path in (("POST", "/v1/runs/caps-run/versions"), ("PUT", f"/v1/runs/caps-run/blobs/{'0' * 64}")):
        answer = send(bulletin.url, method, path, None, _chunks(256 * MiB))
        assert answer.status == 401 and answer.body["type"] == "Unauthorized" and answer.closes, answer
    assert bulletin.body_bytes() == before


def test_bodies_in_flight_stay_within_the_budget(services):
    """Two bodies at the cap hold the sidecar's whole budget (2 x CAP) while they are read; a third is
    answered 503 BodyBudgetExhausted after the budget's wait, reading none of it; once the two end,
    their bytes are given back and a request passes again."""
    _, sidecar = services
    held = [_Exchange(sidecar.url, "POST", "/v1/completions", CAP, {}) for _ in range(2)]
    try:
        for ex in held:
            ex.write(iter([CHUNK]))  # part of the body: the app reads it, the budget holds its whole declared length
            assert ex.pending == b""

        def budget_held() -> float:
            text = httpx.get(f"{sidecar.url}/metrics", timeout=10).text
            return next(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "stitch_sidecar_body_budget_held_bytes"
            )

        wait_for(lambda: budget_held() == 2 * CAP, 30, "two bodies holding the budget")
        before = sidecar.body_bytes()
        answer = send(sidecar.url, "POST", "/v1/completions", CAP, _chunks(CAP), {"content-type": "application/json"})
        assert answer.status == 503 and answer.body["type"] == "BodyBudgetExhausted", answer
        assert answer.body["budget_bytes"] == 2 * CAP and answer.closes
        assert sidecar.body_bytes() == before  # refused before any of it was read
    finally:
        for ex in held:
            ex.sock.close()
    wait_for(lambda: budget_held() == 0, 30, "the budget given back")
    r = httpx.post(f"{sidecar.url}/tokenize", json={"prompt": "ab"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"tokens": [97, 98]}


def test_the_limits_page_names_every_body_route(services):
    """docs/reference/limits.md has a row for each route that takes a body, naming its setting."""
    page = (REPO / "docs" / "reference" / "limits.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("|")]
    for service in services:
        for method, template, _, cap in service.routes():
            if cap:
                assert any(f"`{template}`" in row and (method in row or "any" in row) for row in rows), (
                    method,
                    template,
                )


def test_the_budget_lets_bodies_in_first_come_first_served():
    """A body that does not fit waits, and the ones after it wait behind it even if they would fit; a wait
    cancelled after its bytes were granted gives them back; one that finds no room in time gets False."""

    async def scenario() -> None:
        budget = BodyBudget(100, wait_s=30)
        assert await budget.take(60)
        big, small = asyncio.ensure_future(budget.take(50)), asyncio.ensure_future(budget.take(10))
        await asyncio.sleep(0)
        assert not big.done() and not small.done() and budget.held_bytes == 60
        budget.give(60)  # both fit now, in their order
        assert await big and await small and budget.held_bytes == 60
        late = asyncio.ensure_future(budget.take(50))
        await asyncio.sleep(0)
        budget.give(10)  # room for it: granted, but its request is gone before it resumes
        late.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await late
        assert budget.held_bytes == 50
        assert not await BodyBudget(10, wait_s=0.01).take(11)

    asyncio.run(scenario())
