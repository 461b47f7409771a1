"""A small typed client of a sidecar (runs in the caller: the demo, a trainer, tests).

Speaks :mod:`stitchboard.proto.sidecar_wire`: the status body, the version headers and the
response stamps. Only httpx and the wire models: no FastAPI, no engine code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Self

import httpx

from stitchboard.proto.sidecar_wire import (
    COMMIT_STATES,
    END_FIELD,
    EXACT_HEADER,
    MIN_HEADER,
    START_FIELD,
    WAIT_HEADER,
    SidecarStatus,
)


def version_headers(
    *, min_version: int | None = None, exact_version: int | None = None, wait_s: float | None = None
) -> dict[str, str]:
    """The ``X-Stitch-*`` request headers for a weight-version constraint (None: not sent)."""
    headers = {}
    if min_version is not None:
        headers[MIN_HEADER] = str(min_version)
    if exact_version is not None:
        headers[EXACT_HEADER] = str(exact_version)
    if wait_s is not None:
        headers[WAIT_HEADER] = f"{wait_s:g}"
    return headers


def stamps(answer: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(weight_version_start, weight_version_end)`` of a stamped JSON answer or stream event.

    Raises:
        KeyError: the answer carries no stamps (it did not come through a sidecar).
    """
    return answer[START_FIELD], answer[END_FIELD]


class SidecarClient:
    """Blocking client of one sidecar.

    Args:
        url: the sidecar's base URL, e.g. ``http://127.0.0.1:8000``.
        timeout_s: timeout of one request, seconds (a held request may need more: pass
            ``timeout_s`` per call).
    """

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> SidecarStatus:
        """``GET /v1/stitch/status``.

        Raises:
            httpx.HTTPError: the sidecar does not answer, or answers an error status.
        """
        resp = self._http.get("/v1/stitch/status")
        resp.raise_for_status()
        return SidecarStatus.model_validate(resp.json())

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 (a verified version is applied and the engine holds it)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_status(
        self, predicate: Callable[[SidecarStatus], bool], what: str, timeout_s: float = 300.0, poll_s: float = 0.1
    ) -> SidecarStatus:
        """Poll the status until ``predicate(status)``; returns that status.

        Raises:
            TimeoutError: not within ``timeout_s`` seconds (the message has the last status).
        """
        deadline = time.monotonic() + timeout_s
        last: SidecarStatus | None = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
                if predicate(last):
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"sidecar at {self.url}: no {what} within {timeout_s:g} s; last status {last}")

    def wait_applied(self, version: int, timeout_s: float = 300.0) -> SidecarStatus:
        """Wait until ``version`` is applied and its commit has finished (the engine resumed)."""
        return self.wait_status(
            lambda s: s.applied_version == version and s.state not in COMMIT_STATES,
            f"version {version} applied",
            timeout_s,
        )

    def complete(
        self,
        body: dict[str, Any],
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        wait_s: float | None = None,
        timeout_s: float = 600.0,
    ) -> httpx.Response:
        """``POST /v1/completions`` with ``body`` and a weight-version constraint; the raw answer
        (stamps in its JSON: :func:`stamps`)."""
        headers = version_headers(min_version=min_version, exact_version=exact_version, wait_s=wait_s)
        return self._http.post("/v1/completions", json=body, headers=headers, timeout=timeout_s)
