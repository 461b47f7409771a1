"""The S3 store: :class:`S3Store` (AWS, MinIO, R2, or any S3 API) and its :class:`S3Settings`.

Create-only writes use ``PutObject`` with ``If-None-Match: *``; compare-and-swap uses
``If-Match: <etag>`` (sent bare to a store found to refuse the quoted ETag it hands out, as
radosgw 16 does). Both need a store that implements S3 conditional writes (AWS since 2024,
recent MinIO and R2, radosgw). Files go up with the SHA-256 the bulletin computed while receiving them
(``x-amz-checksum-sha256``; per part for multipart uploads above
``s3_multipart_threshold_bytes``), so S3 refuses a body corrupted on the way (``BadDigest``);
a refused body is sent again up to ``s3_checksum_attempts`` times. The digest is recorded as the
object's metadata ``stitch-sha256`` (:attr:`ObjectStat.sha256`). Presigned URLs are SigV4 in every
region; a presigned PUT signs its payload's SHA-256, so the store refuses other bytes even where it
ignores ``x-amz-checksum-sha256`` (docs/reference/storage.md).

Every S3 call, and every read of a streamed body, runs inside :meth:`S3Store._errors`, the one
place where botocore/boto3 exceptions become the bulletin's typed errors.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import boto3  # type: ignore[import-untyped]
from boto3.exceptions import S3UploadFailedError  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]
from botocore.response import StreamingBody  # type: ignore[import-untyped]
from pydantic import BaseModel, Field

from ..errors import ConflictError, NotFoundError, UnavailableError
from .base import CHUNK_BYTES, ObjectStat, StreamDigest, b64_digest, check_key

MiB = 1 << 20

#: S3 error codes of a conditional write that lost (the object exists, or changed).
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
#: S3 error codes of a missing object.
_MISSING = {"NoSuchKey", "404", "NotFound"}
#: S3 error codes of a body that did not match the checksum sent with it (sent again).
_BAD_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
#: Object metadata holding the SHA-256 (hex) the bulletin computed while receiving the object.
RECORD_META = "stitch-sha256"


class S3Settings(BaseModel):
    """Connection and transfer settings of an :class:`S3Store`.

    :class:`stitchboard.bulletin.settings.BulletinSettings` extends this model, so the same
    fields are the ``STITCH_BULLETIN_S3_*`` environment variables of a bulletin.
    """

    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, R2, ...); None: AWS.")
    s3_region: str | None = Field(None, description="S3 region (None: boto3's default chain).")
    s3_access_key_id: str | None = Field(None, description="S3 access key (None: boto3's default credential chain).")
    s3_secret_access_key: str | None = Field(None, description="S3 secret key.")
    s3_session_token: str | None = Field(None, description="S3 session token.")
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field("auto", description="S3 bucket addressing style.")
    s3_multipart_threshold_bytes: int = Field(
        64 * MiB, gt=0, description="Blobs at least this large go up as multipart uploads, bytes."
    )
    s3_multipart_chunk_bytes: int = Field(64 * MiB, ge=5 * MiB, description="Part size of multipart uploads, bytes.")
    s3_max_concurrency: int = Field(8, gt=0, description="Parallel parts per multipart transfer.")
    s3_checksum_attempts: int = Field(
        3, ge=1, description="Times a body S3 refuses as corrupted (BadDigest) is sent before the upload fails."
    )


def _sign_presigned_payload(request: Any, signature_version: str, **_: Any) -> None:
    """botocore's ``before-sign`` hook: a presigned PUT carrying a SHA-256 checksum signs that digest as its payload
    hash.

    SigV4 presigned URLs normally sign ``UNSIGNED-PAYLOAD``; with ``x-amz-content-sha256: <hex>``
    signed instead, every S3 server refuses other bytes (``XAmzContentSHA256Mismatch``), also
    those that ignore ``x-amz-checksum-sha256`` (radosgw before 18).
    """
    checksum = request.headers.get("x-amz-checksum-sha256")
    if signature_version == "s3v4-query" and checksum:
        request.headers["X-Amz-Content-SHA256"] = base64.b64decode(checksum).hex()


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Store:
    """Objects under ``s3://bucket/prefix``.

    Args:
        bucket: bucket name (must exist).
        prefix: key prefix inside the bucket ("" for the bucket root).
        settings: endpoint, region, credentials and transfer sizes (defaults when ``None``).
    """

    #: Uploads are received in a local temp folder, then sent up (nothing to link to).
    upload_dir: Path | None = None

    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None) -> None:
        s = settings or S3Settings()
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=s.s3_endpoint_url,
            region_name=s.s3_region,
            aws_access_key_id=s.s3_access_key_id,
            aws_secret_access_key=s.s3_secret_access_key,
            aws_session_token=s.s3_session_token,
            config=Config(
                # SigV4 for every request and every presigned URL: botocore presigns with SigV2 in
                # us-east-1 and other old regions, and SigV2 signs neither If-None-Match nor the checksum.
                signature_version="s3v4",
                s3={"addressing_style": s.s3_addressing_style},
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=max(32, s.s3_max_concurrency * 2),
                request_checksum_calculation="when_required",  # we send our own SHA-256, as a header
                response_checksum_validation="when_required",
            ),
        )
        self._client.meta.events.register("before-sign.s3.PutObject", _sign_presigned_payload)
        self.part_bytes: int | None = s.s3_multipart_chunk_bytes
        self._threshold = s.s3_multipart_threshold_bytes
        self._concurrency = s.s3_max_concurrency
        self._attempts = s.s3_checksum_attempts
        #: Whether this store refuses the quoted ETag in ``If-Match`` (found by :meth:`put_cas`).
        self._bare_if_match = False

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Map what boto3 raises inside the block (an S3 call or a body read) for ``key``.

        Raises:
            NotFoundError: S3 has no such object.
            ConflictError: a conditional write lost (the object exists, or its etag changed).
            UnavailableError: any other S3 error answer, or S3 could not be reached, or a
                body stream broke (after boto3's own retries).
        """
        try:
            yield
        except ClientError as exc:
            code = _code(exc)
            if code in _MISSING:
                raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None
            if code in _PRECONDITION:
                raise ConflictError(
                    f"conditional write of {key!r} in {self.url} refused ({code}): the object exists or changed",
                    key=key,
                ) from None
            raise self._unavailable(key, exc) from exc
        except (BotoCoreError, S3UploadFailedError) as exc:
            raise self._unavailable(key, exc) from exc

    def _unavailable(self, key: str, exc: Exception) -> UnavailableError:
        return UnavailableError(
            f"S3 request for {key!r} in {self.url} failed: {exc}; check the endpoint and credentials", key=key
        )

    def stat(self, key: str) -> ObjectStat | None:
        try:
            with self._errors(key):
                r = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except NotFoundError:
            return None
        return ObjectStat(
            key, r["ContentLength"], r["ETag"], r["LastModified"].timestamp(), r.get("Metadata", {}).get(RECORD_META)
        )

    def get(self, key: str) -> tuple[bytes, str]:
        with self._errors(key):
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return r["Body"].read(), r["ETag"]

    def _put(self, key: str, data: bytes, **condition: str) -> bool:
        try:
            with self._errors(key):
                self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
        except ConflictError:
            return False
        except NotFoundError:
            if "IfMatch" in condition:  # the object to replace is gone: the CAS lost
                return False
            raise
        return True

    def put_new(self, key: str, data: bytes) -> bool:
        return self._put(key, data, IfNoneMatch="*")

    def put_cas(self, key: str, data: bytes, etag: str | None) -> bool:
        if not etag:
            return self._put(key, data, IfNoneMatch="*")
        if self._put(key, data, IfMatch=etag.strip('"') if self._bare_if_match else etag):
            return True
        # Some stores compare If-Match with the bare ETag and refuse the quoted one that they
        # hand out and RFC 9110 asks for (radosgw 16, DigitalOcean Spaces): when the refused etag
        # is still the object's, this store is one of them; from then on its ETags go bare.
        if self._bare_if_match or not etag.startswith('"'):
            return False
        current = self.stat(key)
        if current is None or current.etag != etag:
            return False  # the race was lost
        self._bare_if_match = True
        return self._put(key, data, IfMatch=etag.strip('"'))

    def _checked(self, key: str, send: Any) -> Any:
        """``send()``, sent again while S3 refuses the body as corrupted (up to ``s3_checksum_attempts`` times)."""
        for attempt in range(self._attempts):
            try:
                return send()
            except ClientError as exc:
                if _code(exc) not in _BAD_DIGEST or attempt + 1 == self._attempts:
                    raise
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def put_file(self, key: str, path: Path, digest: StreamDigest | None = None) -> None:
        size = path.stat().st_size
        if digest is None or (size >= self._threshold and not digest.parts()):
            digest = StreamDigest.of_file(path, self.part_bytes)
        meta = {RECORD_META: digest.sha256}
        with self._errors(key):
            if size < self._threshold:
                checksum = b64_digest(bytes.fromhex(digest.sha256))

                def send() -> Any:
                    with open(path, "rb") as f:
                        return self._client.put_object(
                            Bucket=self.bucket, Key=self._key(key), Body=f, ChecksumSHA256=checksum, Metadata=meta
                        )

                self._acknowledged(key, self._checked(key, send), checksum)
            else:
                self._put_parts(key, path, digest.parts(), meta)

    def _acknowledged(self, key: str, answer: dict[str, Any], sent: str) -> None:
        """Raise :class:`UnavailableError` when the checksum S3 acknowledged is not the one sent (stores that
        acknowledge none pass)."""
        acknowledged = answer.get("ChecksumSHA256")
        if acknowledged and acknowledged != sent:
            raise UnavailableError(
                f"S3 acknowledged {key!r} in {self.url} with checksum {acknowledged}, not the {sent} sent: "
                "the upload is not trusted; retry it",
                key=key,
            )

    def _put_parts(self, key: str, path: Path, parts: builtins.list[bytes], meta: dict[str, str]) -> None:
        """A multipart upload whose every part carries its SHA-256 (aborted on failure)."""
        part_bytes = self.part_bytes or 0
        upload = self._client.create_multipart_upload(
            Bucket=self.bucket, Key=self._key(key), ChecksumAlgorithm="SHA256", Metadata=meta
        )["UploadId"]

        def put_part(number: int) -> dict[str, Any]:
            checksum = b64_digest(parts[number - 1])

            def send() -> Any:
                with open(path, "rb") as f:
                    f.seek((number - 1) * part_bytes)
                    body = f.read(part_bytes)
                return self._client.upload_part(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    UploadId=upload,
                    PartNumber=number,
                    Body=body,
                    ChecksumSHA256=checksum,
                )

            return {"PartNumber": number, "ETag": self._checked(key, send)["ETag"], "ChecksumSHA256": checksum}

        try:
            with ThreadPoolExecutor(self._concurrency) as pool:
                done = list(pool.map(put_part, range(1, len(parts) + 1)))
            answer = self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload, MultipartUpload={"Parts": done}
            )
            self._acknowledged(key, answer, f"{b64_digest(hashlib.sha256(b''.join(parts)).digest())}-{len(parts)}")
        except BaseException:
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload)
            raise

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        with self._errors(key):
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end}")
        return self._chunks(key, r["Body"])

    def _chunks(self, key: str, body: StreamingBody) -> Iterator[bytes]:
        # The body is read lazily, after the answer's headers went out: map its errors here too.
        with contextlib.closing(body), self._errors(key):
            yield from body.iter_chunks(CHUNK_BYTES)

    def _pages(self, prefix: str, start_after: str | None = None) -> Iterator[dict[str, Any]]:
        kwargs = {"Bucket": self.bucket, "Prefix": self.prefix + prefix, "Delimiter": "/"}
        if start_after:
            kwargs["StartAfter"] = self.prefix + start_after
        with self._errors(prefix):
            yield from self._client.get_paginator("list_objects_v2").paginate(**kwargs)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        if prefix:
            check_key(prefix)
        cut = len(self.prefix)
        for page in self._pages(prefix, start_after):
            for obj in page.get("Contents", []):
                yield ObjectStat(obj["Key"][cut:], obj["Size"], obj["ETag"], obj["LastModified"].timestamp())

    def list_dirs(self, prefix: str) -> builtins.list[str]:  # ``list`` is the method here
        if prefix:
            check_key(prefix)
        start = len(self.prefix + prefix)
        return sorted(
            p["Prefix"][start:].rstrip("/") for page in self._pages(prefix) for p in page.get("CommonPrefixes", [])
        )

    def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError), self._errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def presign(self, key: str, method: str, expires_s: int, sha256: str | None = None) -> str | None:
        """A SigV4 presigned URL (every region; ``expires_s`` at most 604800, SigV4's week).

        A ``PUT`` URL signs the headers :func:`stitchboard.bulletin.client.presigned_put_headers`
        sends: ``x-amz-content-sha256`` (the payload's digest, checked by every S3 server),
        ``x-amz-checksum-sha256``, the record ``x-amz-meta-stitch-sha256`` and ``If-None-Match: *``.
        A request without one of them, or with another value, is refused (403), other bytes too
        (400 ``XAmzContentSHA256Mismatch``), and an existing object is never replaced (412).

        Raises:
            ValueError: a ``PUT`` without ``sha256``.
        """
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}
        if method == "PUT":
            if sha256 is None:
                raise ValueError(f"a presigned PUT of {key!r} needs the object's sha256")
            params.update(
                ChecksumSHA256=b64_digest(bytes.fromhex(sha256)), Metadata={RECORD_META: sha256}, IfNoneMatch="*"
            )
        op = {"GET": "get_object", "PUT": "put_object"}[method]
        with self._errors(key):
            url: str = self._client.generate_presigned_url(op, Params=params, ExpiresIn=expires_s)
        return url

    def remove_temporaries(self, prefix: str, older_than_s: float) -> int:
        # Writes to S3 are atomic; what an interrupted one leaves is an unfinished multipart upload.
        cutoff, removed = time.time() - older_than_s, 0
        with self._errors(prefix):
            for page in self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix + check_key(prefix)
            ):
                for up in page.get("Uploads", []):
                    if up["Initiated"].timestamp() <= cutoff:
                        with contextlib.suppress(ClientError):
                            self._client.abort_multipart_upload(
                                Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                            )
                        removed += 1
        return removed

    def check(self) -> None:
        try:
            with self._errors(""):
                self._client.head_bucket(Bucket=self.bucket)
        except NotFoundError:
            raise UnavailableError(
                f"bucket {self.bucket!r} of {self.url} does not exist: create it, "
                "or fix the store URL (STITCH_BULLETIN_STORE)",
                key="",
            ) from None
