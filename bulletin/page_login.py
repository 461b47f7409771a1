"""The status page's login guard (bulletin process): where a login may come from, and failed logins slowed down.

``POST /status/login`` (:mod:`.page`) sets the cookie that lets a browser read the page, so a
page on another origin must not be able to post a token of its choosing there (login CSRF: the
victim would then browse the attacker's view). :func:`cross_origin` refuses a login whose
``Origin`` (or, without one, ``Referer``) names another host than the request's own ``Host``;
a login with neither header (curl, a script) is taken only when it carries no cookie, since
every browser that sends cookies also sends ``Origin`` on a POST. ``X-Forwarded-Host`` is not
consulted: the bulletin trusts no forwarded header but those uvicorn itself applies from
``forwarded_allow_ips`` (the client's address and scheme), and proxies in front of it keep
``Host`` as the browser sent it (nginx ``proxy_set_header Host $host``, Kubernetes ingresses).

:class:`LoginLimiter` slows down token guessing from one client address (the peer, or the
``X-Forwarded-For`` address uvicorn took from a trusted proxy): the first
:data:`FREE_FAILURES` unknown tokens cost nothing, each further one locks the address out for
twice as long as the one before (from :data:`FIRST_LOCK_S` up to :data:`MAX_LOCK_S`), and a
login during a lock is answered 429 with ``Retry-After`` before its token is looked at. A
successful login, or :data:`FORGET_S` without failures, clears the address. The limiter is
in-memory and per process on purpose: it is no state the bulletin must share (DESIGN.md
invariant 9 is about the store's contents); with several processes an address gets
``FREE_FAILURES`` free guesses from each.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

#: Unknown tokens one address may send before it is slowed down.
FREE_FAILURES = 5
#: The lock after the first failure past the free ones, seconds (doubling at each further failure).
FIRST_LOCK_S = 1.0
#: The longest lock, seconds.
MAX_LOCK_S = 60.0
#: An address with no failure for this long starts again from nothing, seconds.
FORGET_S = 900.0
#: Addresses remembered at most (the least recently failed are forgotten first).
MAX_CLIENTS = 10_000


def _host_port(value: str, scheme: str) -> tuple[str, int] | None:
    """``(host, port)`` of an http(s) URL, or of a bare ``host[:port]`` taken as a URL of ``scheme`` (None: neither)."""
    try:
        parts = urlsplit(value if "//" in value else f"//{value}")
        port = parts.port
    except ValueError:  # a malformed port or address
        return None
    scheme = parts.scheme or scheme
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname, port if port is not None else (443 if scheme == "https" else 80)


def cross_origin(request: Request) -> str | None:
    """Why a login must be refused as coming from another origin, or None when it may go on.

    ``Origin`` is compared with ``Host`` (host and port; the scheme is not compared, so a
    bulletin behind a TLS-terminating proxy still matches); without ``Origin``, ``Referer`` is;
    with neither, the request may go on only if it carries no cookie.
    """
    sent = request.headers.get("origin") or request.headers.get("referer")
    if sent is None:
        if "cookie" in request.headers:
            return "a login that carries cookies must say where it comes from (Origin or Referer)"
        return None
    source = _host_port(sent, "")
    own = _host_port(request.headers.get("host", ""), "https" if sent.startswith("https:") else "http")
    if source is None or own is None or source != own:
        return f"a login from {sent[:200]!r} is refused: log in from this bulletin's own page"
    return None


def client_address(request: Request) -> str:
    """The address the limiter counts for ``request`` (its peer as uvicorn gives it)."""
    return request.client.host if request.client else "unknown"


@dataclass
class _Failures:
    count: int
    locked_until: float
    last: float


class LoginLimiter:
    """Failed logins per client address in this process (see the module docstring); event-loop thread only.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()

    def retry_after_s(self, address: str) -> float:
        """Seconds ``address`` must wait before its next login is looked at (0: now)."""
        now = self._clock()
        seen = self._by_address.get(address)
        if seen is None:
            return 0.0
        if now - seen.last > FORGET_S:
            del self._by_address[address]
            return 0.0
        return max(0.0, seen.locked_until - now)

    def failed(self, address: str) -> None:
        """Count an unknown token from ``address`` (and lock it out once past the free failures)."""
        now = self._clock()
        seen = self._by_address.pop(address, None) or _Failures(0, 0.0, now)
        if now - seen.last > FORGET_S:
            seen = _Failures(0, 0.0, now)
        seen.count += 1
        seen.last = now
        past = seen.count - FREE_FAILURES
        if past > 0:
            seen.locked_until = now + min(MAX_LOCK_S, FIRST_LOCK_S * 2 ** min(past - 1, 32))
        self._by_address[address] = seen
        while len(self._by_address) > MAX_CLIENTS:
            self._by_address.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """A token that may read came from ``address``: forget its failures."""
        self._by_address.pop(address, None)


def retry_after_header(seconds: float) -> dict[str, str]:
    """The ``Retry-After`` header for a wait of ``seconds`` (whole seconds, at least 1)."""
    return {"retry-after": str(max(1, math.ceil(seconds)))}
