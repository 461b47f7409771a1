"""The status page: runs, and per run its version timeline, the fleet's convergence and a replica table (HTML).

* ``GET /status``: the runs the caller may read; ``GET /status/runs/{run}``: one run.
* Behind the same tokens as the API (scope ``read``). A browser presents its token through the
  form the page shows: ``POST /status/login`` (form field ``token``) checks it and sets the
  cookie ``stitch_token`` (``HttpOnly``, ``SameSite=Strict``, path ``/status``, plus ``Secure``
  when served over HTTPS), which only these pages read; ``POST /status/logout`` clears it. A
  client may also send ``Authorization: Bearer``. With no tokens configured the page is open.
* A login from another origin is refused (403) and failed logins from one address are slowed
  down (429 with ``Retry-After``): :mod:`.page_login`.

Plots are matplotlib SVG (:mod:`.page_plots`), drawn in a worker thread; a plot that fails is
logged and replaced by a note, the rest of the page is still served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated
from urllib.parse import parse_qs

from anyio import to_thread
from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from stitchboard.proto.fleet import FleetView
from stitchboard.proto.schema import VersionInfo

from .deps import BulletinState, state_of
from .errors import AuthError, NotFoundError, UnauthorizedError
from .ledger import run_key
from .page_login import LoginLimiter, client_address, cross_origin, retry_after_header
from .page_plots import convergence_svg, timeline_svg
from .page_template import LOGIN, RUN, RUNS, Plot

log = logging.getLogger("stitchboard.bulletin")

router = APIRouter(prefix="/status", tags=["status page"], include_in_schema=False)

#: The cookie holding a browser's token (read by these pages only).
COOKIE = "stitch_token"
#: Versions the page draws and lists (the most recent ones).
PAGE_VERSIONS = 200


def _authorization(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        return header
    token = request.cookies.get(COOKIE)
    return f"Bearer {token}" if token else None


def _login(error: str | None, status: int, headers: dict[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(LOGIN.render(title="log in", error=error, logged_in=False), status_code=status, headers=headers)


def _limiter(request: Request) -> LoginLimiter:
    """This app's limiter of failed logins (made at the first login)."""
    limiter: LoginLimiter | None = getattr(request.app.state, "login_limiter", None)
    if limiter is None:
        limiter = request.app.state.login_limiter = LoginLimiter()
    return limiter


def _allowed(state: BulletinState, request: Request, run: str | None = None) -> HTMLResponse | None:
    """None when the caller may read (``run``); else the login page (401) or a refusal (403)."""
    try:
        state.auth.check(_authorization(request), "read", run)
    except AuthError as exc:
        return _login(
            exc.message if request.cookies.get(COOKIE) or request.headers.get("authorization") else None, exc.status
        )
    return None


@router.get("", response_class=HTMLResponse)
async def runs_page(request: Request) -> Response:
    """The runs this caller may read, with their latest versions."""
    state = state_of(request)
    refused = _allowed(state, request)
    if refused is not None:
        return refused
    authorization = _authorization(request)
    runs = [r for r in await to_thread.run_sync(state.ledger.runs) if state.auth.visible(authorization, r.run_id)]
    return HTMLResponse(RUNS.render(title="runs", runs=runs, logged_in=COOKIE in request.cookies))


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the form's token (it must be able to read) and keep it in an HttpOnly, SameSite=Strict cookie.

    Refused before the token is looked at: a login from another origin (403, :func:`.cross_origin`)
    and one from an address locked out by its failed logins (429 with ``Retry-After``).
    """
    state = state_of(request)
    refused = cross_origin(request)
    if refused is not None:
        return _login(refused, 403)
    limiter, address = _limiter(request), client_address(request)
    wait_s = limiter.retry_after_s(address)
    if wait_s > 0:
        headers = retry_after_header(wait_s)
        return _login(f"too many failed logins from {address}: try again in {headers['retry-after']} s", 429, headers)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    try:
        state.auth.check(f"Bearer {token}", "read")
    except AuthError as exc:
        if isinstance(exc, UnauthorizedError):
            limiter.failed(address)
        return _login(exc.message, exc.status)
    limiter.succeeded(address)
    answer = RedirectResponse("/status", status_code=303)
    answer.set_cookie(
        COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/status"
    )
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Forget the browser's token; refused (403) from another origin, as a login is (:func:`.cross_origin`):
    a page elsewhere must not be able to log its visitor out."""
    refused = cross_origin(request)
    if refused is not None:
        return _login(refused, 403)
    answer = RedirectResponse("/status", status_code=303)
    answer.delete_cookie(COOKIE, path="/status", httponly=True, samesite="strict")
    return answer


def _versions(state: BulletinState, run: str) -> tuple[list[VersionInfo], dict[int, float]]:
    infos, changed = [], {}
    for v in state.ledger.version_numbers(run)[-PAGE_VERSIONS:]:
        try:
            found = state.ledger.committed(run, v)
        except NotFoundError:
            continue  # removed by retention meanwhile
        infos.append(found.info)
        stats = found.manifest.stats
        changed[v] = 100.0 * stats.changed_elements / stats.total_elements if stats.total_elements else 0.0
    return infos, changed


def _plot(run: str, name: str, draw: Callable[[], str]) -> Plot:
    """``draw()``'s SVG, or the note that replaces it when drawing fails (logged with the run's name)."""
    try:
        return Plot(svg=draw())
    except Exception as exc:  # a plot never fails the page: its data is in the tables too
        log.exception("run %s: the %s plot of the status page could not be drawn", run, name)
        return Plot(error=f"the {name} plot could not be drawn ({type(exc).__name__}: {str(exc)[:200]})")


def _render(run: str, view: FleetView, versions: list[VersionInfo], changed: dict[int, float], logged_in: bool) -> str:
    live = [r for r in view.replicas if r.live]
    at_latest = sum(
        1 for r in live if view.latest_version is not None and r.report.applied_version == view.latest_version
    )
    timeline = _plot(run, "version timeline", lambda: timeline_svg(versions, changed))
    convergence = _plot(run, "fleet convergence", lambda: convergence_svg(view, versions))
    return RUN.render(
        title=f"run {run}",
        run=run,
        view=view,
        live=len(live),
        at_latest=at_latest,
        timeline=timeline,
        convergence=convergence,
        versions=versions,
        changed=changed,
        logged_in=logged_in,
    )


@router.get("/runs/{run}", response_class=HTMLResponse)
async def run_page(request: Request, run: Annotated[str, Path()]) -> Response:
    """One run: its version timeline, the fleet's convergence and lag, and every replica with its last error."""
    run_key(run)
    state = state_of(request)
    refused = _allowed(state, request, run)
    if refused is not None:
        return refused
    view = await state.fleet.view(run)
    versions, changed = await to_thread.run_sync(_versions, state, run)
    if not versions and not view.replicas:
        raise NotFoundError(f"run {run!r} has no version and no replica", run_id=run)
    html = await to_thread.run_sync(_render, run, view, versions, changed, COOKIE in request.cookies)
    return HTMLResponse(html)
