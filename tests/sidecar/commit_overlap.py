"""Tools of the real-vLLM test whose requests must be generating while a version is committed.

On 2 cores, a publish (diff, encode, upload: seconds) shares the CPU with the generating engine,
so a test that publishes while requests run cannot tell which ends first. Here the publish runs
up to its commit point first (:class:`HeldPublish`, through :class:`LatchedClient`, a
:class:`BulletinClient` whose commit call waits); the requests start (:class:`LongRequests`);
once both are generating, the commit (one HTTP call) goes through and only the sidecar's sync
overlaps the requests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.schema import VersionInfo, VersionManifest


class LatchedClient(BulletinClient):
    """A :class:`BulletinClient` whose next commit (``publish``) can be held by a :class:`HeldPublish`."""

    latch: HeldPublish | None = None

    def publish(self, manifest: VersionManifest) -> VersionInfo:
        """Commit ``manifest``; if a latch is set, first signal it and wait until it opens (once)."""
        latch, self.latch = self.latch, None
        if latch is not None:
            latch.reached.set()
            if not latch.opened.wait(600):
                raise TimeoutError(f"the held commit of version {manifest.version} was never released")
            if latch.aborted:
                raise RuntimeError(f"the held commit of version {manifest.version} was called off by the test")
        return super().publish(manifest)


class HeldPublish:
    """``publish()`` run in a thread on a :class:`LatchedClient`, held just before its commit.

    Args:
        client: the publisher's client.
        publish: publishes the next version and returns it (e.g. ``VllmRun.publish``).
    """

    def __init__(self, client: LatchedClient, publish: Callable[[], int]) -> None:
        self.reached, self.opened = threading.Event(), threading.Event()
        self.aborted = False
        self.outcome: dict[str, object] = {}
        self.client = client
        client.latch = self
        self.thread = threading.Thread(target=self._run, args=(publish,), name="held-publish", daemon=True)
        self.thread.start()

    def _run(self, publish: Callable[[], int]) -> None:
        try:
            self.outcome["version"] = publish()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_ready/commit
            self.outcome["error"] = exc
        finally:
            if self.client.latch is self:  # the publish ended before its commit: the next one is not held
                self.client.latch = None
            self.reached.set()

    def _raise(self) -> None:
        if "error" in self.outcome:
            raise AssertionError(f"the publish failed: {self.outcome['error']!r}") from self.outcome["error"]  # type: ignore[misc]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until the version is encoded and uploaded and only its commit is left."""
        assert self.reached.wait(timeout_s), f"the publish did not reach its commit in {timeout_s} s"
        self._raise()
        assert "version" not in self.outcome, "the publish ended without a commit"

    def abort(self) -> None:
        """Call the commit off (nothing is committed) and wait for the publish to end; for cleanup."""
        self.aborted = True
        self.opened.set()
        self.thread.join(60)

    def commit(self, timeout_s: float = 300.0) -> int:
        """Let the commit go through; returns the committed version."""
        self.opened.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the commit did not return in {timeout_s} s"
        self._raise()
        return self.outcome["version"]  # type: ignore[return-value]


class LongRequests:
    """One streamed and one plain greedy completion of exactly ``tokens`` tokens, sent through ``url``.

    Attributes:
        events: the streamed answer's ``data:`` events, filled as they arrive.
        plain: the plain answer once it is back.
        failures: what went wrong with either (an answer other than 200, or an exception).
    """

    def __init__(self, url: str, model: str, prompt: str, tokens: int) -> None:
        self.body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
        self.url = f"{url}/v1/completions"
        self.events: list[dict] = []
        self.plain: httpx.Response | None = None
        self.failures: list[str] = []
        self.threads = [
            threading.Thread(target=self._guard, args=(f,), daemon=True) for f in (self._stream, self._plain)
        ]
        for t in self.threads:
            t.start()

    def _guard(self, request: Callable[[], None]) -> None:
        try:
            request()
        except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
            self.failures.append(f"{request.__name__}: {exc!r}")

    def _stream(self) -> None:
        body = {**self.body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url, json=body, timeout=600) as r:
            if r.status_code != 200:
                self.failures.append(f"streamed: {r.status_code} {r.read().decode(errors='replace')[:2000]}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))

    def _plain(self) -> None:
        self.plain = httpx.post(self.url, json=self.body, timeout=600)
        if self.plain.status_code != 200:
            self.failures.append(f"plain: {self.plain.status_code} {self.plain.text[:2000]}")

    def alive(self) -> bool:
        """Whether both are still running."""
        return all(t.is_alive() for t in self.threads)

    def wait_generating(self, status: Callable[[], dict], timeout_s: float = 300.0) -> None:
        """Wait until the sidecar's ``status()`` counts both in flight and the stream's first tokens arrived.

        Fails at once, with what the engine answered, if either ends first.
        """
        deadline = time.monotonic() + timeout_s
        last: dict | str = "none yet"
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(
                    f"a request ended before both were generating: {self.failures or 'no error so far'}; "
                    f"{len(self.events)} events streamed; sidecar status {last}"
                )
            try:
                last = status()
            except httpx.HTTPError as exc:
                last = repr(exc)
            if self.events and isinstance(last, dict) and last["requests_in_flight"] == 2:
                return
            time.sleep(0.05)
        raise AssertionError(
            f"the requests were not both generating after {timeout_s} s: {len(self.events)} events streamed; sidecar "
            f"status {last}"
        )

    def join(self, timeout_s: float = 600.0) -> None:
        """Wait for both answers."""
        for t in self.threads:
            t.join(timeout_s)
