"""The HTTP client of the bulletin, shared by the CLI, the trainer SDK and the sidecar.

Imports only httpx and :mod:`stitchboard.proto` (no FastAPI), so it works without the
``bulletin`` extra. Blocking; one instance may be shared between threads (httpx.Client is
thread-safe). Every method raises the :mod:`stitchboard.bulletin.errors` tree:

* transport errors and 5xx answers are retried with exponential backoff (``retries`` times),
  then raised as :class:`UnavailableError` (or the 5xx body's type);
* 4xx answers are never retried: 401/403 -> :class:`AuthError`, 404 -> :class:`NotFoundError`,
  409 -> :class:`ConflictError` subclasses, other 4xx -> :class:`InvalidRequestError` subclasses;
* an answer for another run or version than asked raises :class:`MisdirectedAnswerError`
  (:mod:`.answer_checks`), as a blob whose bytes hash to another sha256 raises
  :class:`BlobMismatchError`: nothing of it is used.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx

from stitchboard.proto.answers import RunList, UploadUrl, VersionPage
from stitchboard.proto.schema import Plan, RunInfo, VersionInfo, VersionManifest, canonical_json, parse_manifest
from stitchboard.proto.squash_schema import SquashList, SquashManifest

from .answer_checks import check_answer, check_newer, check_plan
from .errors import BlobMismatchError, BulletinError, UnavailableError, error_from_body
from .steps import same_step_and_bits

_RETRY_STATUS = {500, 502, 503, 504}
_CHUNK = 1 << 20
#: The longest wait between two attempts, seconds.
BACKOFF_CAP_S = 10.0


def backoff_delay_s(attempt: int, base_s: float, rng: Callable[[], float] = random.random) -> float:
    """The wait before retry ``attempt + 1``, seconds: "full jitter", uniform in [0, min(cap, base * 2**attempt)).

    Every client draws its own wait over the whole window, so 1,000 replicas throttled together (S3's 503
    SlowDown on one prefix) spread their retries over it instead of coming back in one burst; a fixed or
    half-jittered wait keeps them in step (docs/scale.md, "Backoff"; AWS Architecture Blog, "Exponential Backoff
    And Jitter"). ``rng`` returns a float in [0, 1) (a test passes a fixed one).
    """
    return float(rng() * min(BACKOFF_CAP_S, base_s * 2.0**attempt))


def presigned_put_headers(sha256: str) -> dict[str, str]:
    """The headers a presigned ``PUT`` of blob ``sha256`` carries, as the bulletin signed them (SigV4).

    The payload's digest (``x-amz-content-sha256``, hex: every S3 server checks it), its checksum,
    its record and create-only; a request missing one is refused (see ``S3Store.presign``).
    """
    return {
        "x-amz-content-sha256": sha256,
        "x-amz-checksum-sha256": base64.b64encode(bytes.fromhex(sha256)).decode(),
        "x-amz-meta-stitch-sha256": sha256,
        "if-none-match": "*",
    }


class BulletinClient:
    """Talks to one bulletin.

    Args:
        url: base URL of the bulletin, e.g. ``http://bulletin:8700``.
        token: bearer token (scope ``read``, or ``publish`` for uploads and publishes); None for an open bulletin.
        timeout_s: connect/read/write timeout of one request, seconds (a long-poll adds its ``wait_s``).
        retries: extra attempts after a transport error or 5xx answer (0: try once).
        backoff_s: the first retry's longest wait, seconds; doubles each attempt (capped at 10 s); each wait is
            drawn uniformly below it (full jitter, :func:`backoff_delay_s`).
        transport: an httpx transport to use instead of the network (e.g. ``httpx.ASGITransport`` in tests).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 0.25,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)
        self._presign: bool | None = None
        # Presigned uploads go straight to the object store, without our token, on a client of their own made at the
        # first one: a one-off httpx.put builds a client and its SSL context per blob (30-40 ms of CPU each, measured
        # on the CI's 2-core host), on the publish path.
        self._store: httpx.Client | None = None
        self._store_lock = threading.Lock()

    def close(self) -> None:
        """Close the connection pools."""
        self._http.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _retrying(self, send: Callable[[], httpx.Response], what: str) -> httpx.Response:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = send()
            except httpx.TransportError as exc:
                if last:
                    raise UnavailableError(
                        f"{what}: bulletin {self.url} unreachable after {attempt + 1} attempts: {exc!r}; "
                        "check the URL and that it is up"
                    ) from exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in _RETRY_STATUS or last:
                    raise self._error(response)
            time.sleep(backoff_delay_s(attempt, self.backoff_s))
        raise AssertionError("unreachable")

    @staticmethod
    def _error(response: httpx.Response) -> BulletinError:
        response.read()
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        return error_from_body(response.status_code, body)

    def _call(self, method: str, path: str, *, what: str, **kwargs: Any) -> httpx.Response:
        return self._retrying(lambda: self._http.request(method, path, **kwargs), what)

    # -- blobs -------------------------------------------------------------------------------

    def has_blob(self, run: str, sha256: str) -> int | None:
        """Size in bytes of the stored blob, or ``None`` if the bulletin does not have it."""
        try:
            r = self._call("HEAD", f"/v1/runs/{run}/blobs/{sha256}", what=f"checking blob {sha256} of run {run!r}")
        except BulletinError as exc:
            if exc.status == 404:
                return None
            raise
        return int(r.headers["content-length"])

    def put_blob(
        self,
        run: str,
        sha256: str,
        source: str | os.PathLike[str] | bytes,
        size_bytes: int | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Upload one file (patch, snapshot shard or asset) unless the bulletin already has it.

        A presigned URL (S3) is used when the bulletin hands one out; when the store already
        holds the object (412) the file goes through the bulletin instead, which replaces a
        stored copy that fails its check.

        Args:
            run: run id.
            sha256: lowercase hex sha256 of the bytes (the bulletin verifies it while receiving).
            source: a file path (streamed) or the bytes.
            size_bytes: the size in bytes (default: measured); verified by the bulletin.
            force: send it even if the bulletin says it has it (repairs a stored copy that a
                reader found corrupt: the bulletin re-checks its copy and replaces a bad one).

        Returns:
            True if uploaded, False if an identical blob was already stored.

        Raises:
            BlobMismatchError: the bytes do not hash to ``sha256`` or differ from ``size_bytes``.
            PayloadTooLargeError: over the bulletin's ``max_blob_bytes``.
            AuthError, UnavailableError: see the module docstring.
        """
        size = (
            size_bytes
            if size_bytes is not None
            else (len(source) if isinstance(source, bytes) else os.path.getsize(source))
        )
        if not force and self.has_blob(run, sha256) == size:
            return False
        what = f"uploading blob {sha256} of run {run!r}"
        url = None
        if self._presign is not False:
            answer = self._call(
                "POST", f"/v1/runs/{run}/blobs/{sha256}/upload-url", params={"size_bytes": size}, what=what
            )
            url = UploadUrl.model_validate_json(answer.content).url
            self._presign = url is not None

        def send(presigned: str | None) -> httpx.Response:
            body = source if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115 - closed below
            try:
                headers = {"content-length": str(size), "content-type": "application/octet-stream"}
                if presigned is not None:  # straight to the object store, without our token
                    with self._store_lock:  # uploads may run on several threads
                        if self._store is None:
                            self._store = httpx.Client(timeout=self.timeout_s)
                    return self._store.put(
                        presigned, content=body, headers={**headers, **presigned_put_headers(sha256)}
                    )
                return self._http.put(
                    f"/v1/runs/{run}/blobs/{sha256}", params={"size_bytes": size}, content=body, headers=headers
                )
            finally:
                if not isinstance(body, bytes):
                    body.close()

        if url is not None:
            try:
                self._retrying(lambda: send(url), what)
                return True
            except BulletinError as exc:
                if exc.status != 412:  # 412: the store has the object; the bulletin checks (and repairs) it
                    raise
        answer = self._retrying(lambda: send(None), what)
        return answer.status_code == 201

    def download_blob(
        self, run: str, sha256: str, dest: str | os.PathLike[str], expected_size: int | None = None
    ) -> Path:
        """Download a blob to ``dest``, verifying its sha256 (and size); resumes ``dest + '.part'`` via Range.

        The file appears at ``dest`` only once verified (atomic rename).

        Args:
            run: run id.
            sha256: expected lowercase hex sha256.
            dest: final path of the file.
            expected_size: expected size in bytes, if known.

        Returns:
            ``dest`` as a Path.

        Raises:
            NotFoundError: the bulletin has no such blob.
            BlobMismatchError: the received bytes do not match ``sha256``/``expected_size`` (the partial file is
            removed).
            AuthError, UnavailableError: see the module docstring.
        """
        dest = Path(dest)
        part = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        what = f"downloading blob {sha256} of run {run!r}"
        for attempt in range(self.retries + 1):
            if self._fetch_part(run, sha256, part, may_retry=attempt < self.retries, what=what):
                break
            time.sleep(backoff_delay_s(attempt, self.backoff_s))
        digest, size = hashlib.sha256(), 0
        with open(part, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        if digest.hexdigest() != sha256 or (expected_size is not None and size != expected_size):
            part.unlink()
            raise BlobMismatchError(
                f"{what}: got {size} bytes hashing to {digest.hexdigest()}, expected "
                f"{expected_size if expected_size is not None else '?'} bytes with sha256 {sha256}; "
                "the partial file was removed, retry; if a retry gets the same bytes, the stored copy is corrupt: "
                "upload the file again (put_blob(..., force=True): the bulletin replaces a stored copy that fails "
                "its check)",
                run_id=run,
                sha256=sha256,
            )
        os.replace(part, dest)
        return dest

    def _fetch_part(self, run: str, sha256: str, part: Path, *, may_retry: bool, what: str) -> bool:
        # Appends the rest of the blob to ``part``; False when the attempt should be retried.
        have = part.stat().st_size if part.exists() else 0
        headers = {"range": f"bytes={have}-"} if have else {}
        try:
            with self._http.stream(
                "GET", f"/v1/runs/{run}/blobs/{sha256}", headers=headers, follow_redirects=True
            ) as r:
                if r.status_code == 416:  # the partial file already holds the whole blob
                    return True
                if r.status_code >= 400:
                    if r.status_code in _RETRY_STATUS and may_retry:
                        return False
                    raise self._error(r)
                with open(part, "ab" if r.status_code == 206 else "wb") as f:
                    f.writelines(r.iter_bytes(_CHUNK))
        except httpx.TransportError as exc:
            if may_retry:
                return False
            raise UnavailableError(
                f"{what}: bulletin {self.url} unreachable after {self.retries + 1} attempts: {exc!r}"
            ) from exc
        return True

    # -- versions ----------------------------------------------------------------------------

    def publish(self, manifest: VersionManifest) -> VersionInfo:
        """Publish a version (all its files uploaded first). Safe to retry: an identical manifest is a no-op.

        Returns:
            The committed version's info; the latest version's (``manifest.version - 1``) when it
            records the manifest's step with the same bits (a no-op, see :mod:`.steps`).

        Raises:
            BlobMissingError, BlobMismatchError: a file is not uploaded or has another size.
            VersionConflictError: the version exists with different content, or the step rule refuses it
                (a step below the latest's, or the latest's step with other bits).
            VersionRewindError, BaseMissingError: not the run's next version.
            InvalidRequestError, PayloadTooLargeError, AuthError, UnavailableError.
            MisdirectedAnswerError: the answer is for another run or version (a no-op answer is
                checked against that version's manifest).
        """
        body = canonical_json(manifest)
        r = self._call(
            "POST",
            f"/v1/runs/{manifest.run_id}/versions",
            content=body,
            headers={"content-type": "application/json"},
            what=f"publishing version {manifest.version} of run {manifest.run_id!r}",
        )
        info = VersionInfo.model_validate_json(r.content)
        what = f"publishing version {manifest.version} of run {manifest.run_id!r}"
        check_answer(what, manifest.run_id, info.run_id)
        if info.version == manifest.version - 1 and r.status_code == 200:
            # a no-op: the latest version holds this step with these bits (bulletin/steps.py); checked before use
            held = self.manifest(manifest.run_id, info.version)
            if same_step_and_bits(held, manifest):
                return info
        check_answer(what, manifest.run_id, info.run_id, manifest.version, info.version)
        return info

    def latest_info(self, run: str, after: int = -1, wait_s: float = 0.0) -> VersionInfo | None:
        """Like :meth:`latest` but returns the :class:`VersionInfo` (``None`` if nothing newer)."""
        what = f"asking the latest version of run {run!r}"
        r = self._call(
            "GET",
            f"/v1/runs/{run}/versions/latest",
            params={"after": after, "wait_s": wait_s},
            timeout=httpx.Timeout(self.timeout_s, read=self.timeout_s + wait_s),
            what=what,
        )
        if r.status_code == 204:
            return None
        info = VersionInfo.model_validate_json(r.content)
        check_newer(what, run, info.run_id, after, info.version)
        return info

    def latest(self, run: str, after: int = -1, wait_s: float = 0.0) -> int | None:
        """The run's latest version once it is greater than ``after``, waiting up to ``wait_s`` seconds.

        Returns:
            The version, or ``None`` when the run has nothing newer than ``after`` after the
            wait (also for a run with no version yet).

        Raises:
            MisdirectedAnswerError: the answer names another run, or a version not after ``after``.
        """
        info = self.latest_info(run, after, wait_s)
        return None if info is None else info.version

    def manifest(self, run: str, version: int) -> VersionManifest:
        """The manifest of one version.

        Raises:
            NotFoundError: it is not (or no longer) stored.
            MisdirectedAnswerError: the answer is another run's or version's manifest.
        """
        what = f"reading version {version} of run {run!r}"
        r = self._call("GET", f"/v1/runs/{run}/versions/{version}", what=what)
        manifest = parse_manifest(r.content)
        check_answer(what, run, manifest.run_id, version, manifest.version)
        return manifest

    def versions(self, run: str, after: int = -1, limit: int | None = None) -> list[VersionInfo]:
        """Committed versions greater than ``after``, ascending, at most ``limit`` (None: all; follows pages).

        Raises:
            MisdirectedAnswerError: a listed version is another run's, or not after the one before it.
        """
        out: list[VersionInfo] = []
        what = f"listing versions of run {run!r}"
        while limit is None or len(out) < limit:
            page = 1000 if limit is None else min(1000, limit - len(out))
            r = self._call("GET", f"/v1/runs/{run}/versions", params={"after": after, "limit": page}, what=what)
            answer = VersionPage.model_validate_json(r.content)
            previous = after
            for info in answer.versions:
                check_newer(what, run, info.run_id, previous, info.version)
                previous = info.version
            out.extend(answer.versions)
            if answer.next_after is None:
                break
            after = answer.next_after
        return out

    def version_for_step(self, run: str, step: int) -> VersionInfo | None:
        """The first committed version of ``run`` whose manifest records training step ``step`` or later.

        Returns:
            Its info, or None when no version is at ``step`` or later (also for a run without versions).

        Raises:
            MisdirectedAnswerError: the answer names another run.
        """
        what = f"looking up step {step} of run {run!r}"
        try:
            r = self._call("GET", f"/v1/runs/{run}/versions", params={"step": step}, what=what)
        except BulletinError as exc:
            if exc.status == 404:
                return None
            raise
        info = VersionInfo.model_validate_json(r.content)
        check_answer(what, run, info.run_id)
        return info

    def runs(self) -> list[RunInfo]:
        """Every run the token may read, with its latest version."""
        r = self._call("GET", "/v1/runs", what="listing runs")
        return RunList.model_validate_json(r.content).runs

    def plan(
        self, run: str, from_version: int | None = None, to_version: int | None = None, *, squash: bool = False
    ) -> Plan:
        """The files to fetch, in order, to go from ``from_version`` (None: nothing held) to ``to_version`` (None:
        latest).

        ``squash=True`` says the caller applies ``squash`` steps (one patch from an older
        version, :attr:`PlanStep.base_version`): the route may then use the run's squashes.

        Raises:
            NotFoundError: the run has no such version, or no complete route remains.
            MisdirectedAnswerError: the plan is another run's, or not a route between the versions asked.
        """
        params: dict[str, int | str] = {k: v for k, v in (("from", from_version), ("to", to_version)) if v is not None}
        if squash:
            params["squash"] = "true"
        what = f"planning run {run!r} from {from_version} to {to_version}"
        r = self._call("GET", f"/v1/runs/{run}/plan", params=params, what=what)
        plan = Plan.model_validate_json(r.content)
        check_plan(what, plan, run, from_version, to_version)
        return plan

    # -- squashes ----------------------------------------------------------------------------

    def put_squash(self, squash: SquashManifest) -> bool:
        """Store a squash record (its files uploaded first). True if stored now, False if the identical one was.

        Raises:
            NotFoundError: a version of it is not committed.
            InvalidRequestError: it disagrees with its versions; BlobMissingError, BlobMismatchError: a file.
            VersionConflictError: another record is stored for the span (drop it first).
        """
        run, span = squash.run_id, f"{squash.base_version}/{squash.target_version}"
        r = self._call(
            "PUT",
            f"/v1/runs/{run}/squashes/{span}",
            content=canonical_json(squash),
            headers={"content-type": "application/json"},
            what=f"storing squash {span} of run {run!r}",
        )
        return r.status_code == 201

    def squashes(self, run: str) -> list[SquashManifest]:
        """Every squash record of ``run``.

        Raises:
            MisdirectedAnswerError: a record is another run's.
        """
        what = f"listing squashes of run {run!r}"
        r = self._call("GET", f"/v1/runs/{run}/squashes", what=what)
        records = SquashList.model_validate_json(r.content).squashes
        for record in records:
            check_answer(what, run, record.run_id)
        return records

    def drop_squash(self, run: str, base: int, target: int) -> bool:
        """Drop one squash record; False if it was not stored."""
        try:
            self._call(
                "DELETE",
                f"/v1/runs/{run}/squashes/{base}/{target}",
                what=f"dropping squash {base}/{target} of run {run!r}",
            )
        except BulletinError as exc:
            if exc.status == 404:
                return False
            raise
        return True
