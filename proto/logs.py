"""Log lines every stitchboard process writes: plain text (the default) or JSON lines, one object per line.

Runs in every stitchboard process that configures logging: the bulletin server (each uvicorn worker),
the sidecar, and the client CLIs (``publish``, ``watch``, ``squash rebuild``). docs/reference/logging.md
describes the setting and the fields.

* :func:`logging_config`: the :func:`logging.config.dictConfig` dict of a process: one handler on stderr
  for the root logger and uvicorn's loggers (its error and access lines get the same format). A server
  passes it to ``uvicorn.run(log_config=...)`` (each worker process applies it); a CLI calls
  :func:`configure_logging`.
* JSON lines: python-json-logger's formatter, fields ``time`` (ISO 8601, UTC), ``level``, ``logger``,
  ``message``, then ``run``, ``version``, ``replica``, ``request_id`` where they apply, and any
  ``extra=`` a call site passes.
* Where the fields come from, without the call sites changing: :class:`ContextFilter` (on the handler)
  adds the process's own fields (a sidecar's run and replica) and those bound in the current
  :mod:`contextvars` context (:func:`bind`); :class:`RequestContext`, an ASGI wrapper around a server's
  app, binds each HTTP request's id (its ``X-Request-Id``, else a new one), the run and version its path
  names and the version its answer is stamped with, for the app's lines and uvicorn's access line.
"""

from __future__ import annotations

import contextvars
import logging
import logging.config
import os
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Any

import typer
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

#: The text format (``text``): the one the sidecar always had.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The client CLIs' variable (the bulletin's and the sidecar's are fields of their settings).
CLIENT_ENV = "STITCH_CLIENT_LOG_FORMAT"

_BOUND: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "stitch_log_fields", default=MappingProxyType({})
)


class LogFormat(StrEnum):
    """How a process writes its log lines: ``text`` (``<time> <LEVEL> <logger>: <message>``) or ``json`` (one
    JSON object per line)."""

    text = "text"
    json = "json"


@contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (``run``, ``version``, ``replica``, ``request_id``, or others; None values are left out) to
    every line logged in this context (the current thread or asyncio task, and the tasks it starts) until the block
    ends."""
    token = _BOUND.set({**_BOUND.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _BOUND.reset(token)


class ContextFilter(logging.Filter):
    """Adds the process's ``fields`` and the fields bound in the current context (:func:`bind`) to each record as
    attributes (the bound ones win); filters nothing out.

    Args:
        fields: the process's own fields, e.g. a sidecar's ``run`` and ``replica`` (None values are left out).
    """

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = {k: v for k, v in (fields or {}).items() if v is not None}

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in {**self.fields, **_BOUND.get()}.items():
            if not hasattr(record, name):  # a call site's own extra= wins
                setattr(record, name, value)
        return True


class JsonLines(JsonFormatter):
    """One JSON object per record: ``time`` (ISO 8601 UTC), ``level``, ``logger``, ``message``, the context
    fields and any ``extra=``; a traceback goes in ``exc_info``. uvicorn's ``color_message`` is left out."""

    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
            reserved_attrs=[*RESERVED_ATTRS, "color_message"],
        )


def stderr_handler(
    log_format: LogFormat | str, fields: Mapping[str, Any] | None = None, text_format: str = TEXT_FORMAT
) -> logging.Handler:
    """The handler a process logs through: stderr, ``log_format``, a :class:`ContextFilter` with ``fields``.
    With ``json``, Python's warnings are logged through it too (``py.warnings``), so every line stays JSON.

    Args:
        log_format: ``text`` or ``json`` (:class:`LogFormat`).
        fields: the process's own fields (e.g. ``run``, ``replica``; None values left out).
        text_format: the ``%``-style format of ``text`` lines.

    Raises:
        ValueError: ``log_format`` is not a :class:`LogFormat`.
    """
    as_json = LogFormat(log_format) is LogFormat.json
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if as_json else logging.Formatter(text_format))
    handler.addFilter(ContextFilter(fields))
    if as_json:
        logging.captureWarnings(True)
    return handler


def logging_config(
    log_format: LogFormat | str, level: str = "info", fields: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The :func:`logging.config.dictConfig` dict of a server process (``uvicorn.run(log_config=...)``): the root
    logger and uvicorn's (``uvicorn``, ``uvicorn.error``, ``uvicorn.access``) write through one
    :func:`stderr_handler`.

    Args:
        log_format: ``text`` or ``json`` (:class:`LogFormat`).
        level: the root logger's level name (``debug``, ``info``, ``warning``...; any case).
        fields: the process's own fields for :class:`ContextFilter` (e.g. ``run``, ``replica``).

    Raises:
        ValueError: ``log_format`` is not a :class:`LogFormat`.
    """
    handler = {"()": f"{__name__}.stderr_handler", "log_format": LogFormat(log_format).value, "fields": fields}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"stderr": handler},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


def configure_logging(
    log_format: LogFormat | str,
    level: int | str = logging.INFO,
    fields: Mapping[str, Any] | None = None,
    text_format: str = TEXT_FORMAT,
) -> None:
    """Configure a CLI's logging as :func:`logging.basicConfig` does (nothing changes where the root logger already
    has a handler): one :func:`stderr_handler` (a server passes :func:`logging_config` to uvicorn instead).

    Args:
        log_format: ``text`` or ``json``.
        level: the root logger's level (a :mod:`logging` constant or its name).
        fields: the process's own fields for :class:`ContextFilter` (e.g. the ``run`` a CLI publishes to).
        text_format: the ``%``-style format of ``text`` lines (a CLI's own, e.g. ``"%(message)s"``).

    Raises:
        ValueError: ``log_format`` is not a :class:`LogFormat`.
    """
    if logging.getLogger().handlers:
        return
    handler = stderr_handler(log_format, fields, text_format)
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler])


#: ``--log-format`` of the client CLIs (``publish``, ``watch``, ``squash rebuild``).
LogFormatOption = Annotated[
    LogFormat,
    typer.Option("--log-format", envvar=CLIENT_ENV, help="log lines as text or JSON lines (docs/reference/logging.md)"),
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class RequestContext:
    """ASGI wrapper binding each HTTP request's log fields (:func:`bind`) while the app handles it.

    ``request_id``: the request's ``X-Request-Id`` (at most 128 characters kept), else a new 32-hex-digit id;
    ``run``, ``version`` and ``replica``: the named groups of ``path`` matched at the start of the request's path;
    ``version`` is replaced, when the answer starts, by the value of its ``version_header`` (the sidecar's stamp),
    so uvicorn's access line carries the version that served the request. Other scopes pass through.

    Args:
        app: the ASGI app.
        path: a pattern with groups among ``run``, ``version``, ``replica`` (None: none taken from the path).
        version_header: the answer's header holding the version it was served at (None: none read).
    """

    def __init__(self, app: ASGIApp, path: re.Pattern[str] | None = None, version_header: str | None = None) -> None:
        self.app = app
        self.path = path
        self.version_header = version_header.lower().encode("latin-1") if version_header else None

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Per request, on every answer's path: plain ContextVar set/reset, no generator context manager.
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                given = value
                break
        fields: dict[str, Any] = {**_BOUND.get(), "request_id": given.decode("latin-1")[:128] or os.urandom(16).hex()}
        matched = self.path.match(scope.get("path", "")) if self.path is not None else None
        if matched is not None:
            for key, value in matched.groupdict().items():
                if value:
                    fields[key] = int(value) if key == "version" else value
        wanted = self.version_header

        async def stamped_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                for name, value in message.get("headers", ()):
                    if name.lower() == wanted and value.isdigit():
                        stamped = _BOUND.set({**_BOUND.get(), "version": int(value)})
                        try:
                            await send(message)  # uvicorn writes the access line inside this send
                        finally:
                            _BOUND.reset(stamped)
                        return
            await send(message)

        token = _BOUND.set(fields)
        try:
            await self.app(scope, receive, send if wanted is None else stamped_send)
        finally:
            _BOUND.reset(token)
