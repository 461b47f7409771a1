"""A pytest plugin that counts the malformed inputs the tests try, per surface (the figures in docs/reliability.md).

Run: ``python -m pytest -q -p tests.codec.count_refusals tests/codec tests/bulletin tests/trainer_client``.
At the end it prints, per surface, how many refusals the tests provoked and saw:

- REST: HTTP answers 400-499 received over loopback (httpx; HEAD requests left out);
- patch files: ``pytest.raises`` that caught a :class:`PatchError` (codec reads and applies);
- manifests: ``pytest.raises`` that caught a :class:`SchemaError` or a pydantic ``ValidationError``;
- CLI: command runs (``typer`` ``CliRunner`` or a ``stitchboard`` subprocess) that exited non-zero.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from stitchboard.proto.errors import PatchError, SchemaError

COUNTS: Counter[str] = Counter()


def _count_raise(exc: BaseException | None) -> None:
    if isinstance(exc, PatchError):
        COUNTS["patch files"] += 1
    elif isinstance(exc, SchemaError | ValidationError):
        COUNTS["manifests"] += 1


def pytest_configure(config: pytest.Config) -> None:
    raises, send, invoke, run = pytest.raises, httpx.Client.send, CliRunner.invoke, subprocess.run

    @contextmanager
    def counted_raises(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with raises(*args, **kwargs) as info:
            yield info
        _count_raise(info.value)

    def counted_send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = send(self, request, **kwargs)
        if (
            400 <= response.status_code < 500 and request.method != "HEAD"
        ):  # a HEAD 404 is the SDK asking whether a blob is stored
            COUNTS["REST"] += 1
        return response

    def counted_invoke(self: CliRunner, *args: Any, **kwargs: Any) -> Any:
        result = invoke(self, *args, **kwargs)
        COUNTS["CLI"] += result.exit_code != 0
        return result

    def counted_run(*args: Any, **kwargs: Any) -> Any:
        proc = run(*args, **kwargs)
        COUNTS["CLI"] += proc.returncode != 0 and "stitchboard" in str(args[0] if args else kwargs.get("args"))
        return proc

    pytest.raises = counted_raises  # type: ignore[assignment]
    httpx.Client.send = counted_send  # type: ignore[method-assign]
    CliRunner.invoke = counted_invoke  # type: ignore[method-assign]
    subprocess.run = counted_run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        "malformed inputs refused, per surface: "
        + ", ".join(f"{k} {COUNTS[k]}" for k in ("REST", "patch files", "manifests", "CLI"))
    )
