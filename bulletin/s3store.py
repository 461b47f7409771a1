"""The S3 backend of :class:`stitchboard.bulletin.store.Store` (AWS, MinIO, R2, or any S3 API).

Create-only writes use ``PutObject`` with ``If-None-Match: *``; compare-and-swap uses
``If-Match: <etag>``. Both need a store that implements S3 conditional writes (AWS since 2024,
recent MinIO and R2). Files go up through boto3's transfer manager (multipart above
``s3_multipart_threshold_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .errors import NotFoundError, UnavailableError
from .store import ObjectStat, check_key

if TYPE_CHECKING:
    from .settings import BulletinSettings

_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Store:
    """Objects under ``s3://bucket/prefix``.

    Args:
        bucket: bucket name (must exist).
        prefix: key prefix inside the bucket ("" for the bucket root).
        settings: endpoint, region, credentials and transfer sizes (defaults when ``None``).
    """

    def __init__(self, bucket: str, prefix: str = "", settings: BulletinSettings | None = None) -> None:
        from .settings import BulletinSettings

        s = settings or BulletinSettings()
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
                s3={"addressing_style": s.s3_addressing_style},
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=max(32, s.s3_max_concurrency * 2),
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=s.s3_multipart_threshold_bytes,
            multipart_chunksize=s.s3_multipart_chunk_bytes,
            max_concurrency=s.s3_max_concurrency,
        )

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _unavailable(self, key: str, exc: Exception) -> UnavailableError:
        return UnavailableError(f"S3 request for {key!r} in {self.url} failed: {exc}; check the endpoint and credentials", key=key)

    def stat(self, key: str) -> ObjectStat | None:
        try:
            r = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise self._unavailable(key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable(key, exc) from exc
        return ObjectStat(key, r["ContentLength"], r["ETag"], r["LastModified"].timestamp())

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return r["Body"].read(), r["ETag"]
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None
            raise self._unavailable(key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable(key, exc) from exc

    def _put(self, key: str, data: bytes, **condition: str) -> bool:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
        except ClientError as exc:
            if _code(exc) in _PRECONDITION or (_code(exc) in _MISSING and "IfMatch" in condition):
                return False
            raise self._unavailable(key, exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable(key, exc) from exc
        return True

    def put_new(self, key: str, data: bytes) -> bool:
        return self._put(key, data, IfNoneMatch="*")

    def put_cas(self, key: str, data: bytes, etag: str | None) -> bool:
        return self._put(key, data, **({"IfMatch": etag} if etag else {"IfNoneMatch": "*"}))

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)
        except (ClientError, BotoCoreError, boto3.exceptions.S3UploadFailedError) as exc:
            raise self._unavailable(key, exc) from exc

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end}")
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None
            raise self._unavailable(key, exc) from exc
        return r["Body"].iter_chunks(1 << 20)

    def _pages(self, prefix: str, start_after: str | None = None) -> Iterator[dict]:
        kwargs = {"Bucket": self.bucket, "Prefix": self.prefix + prefix, "Delimiter": "/"}
        if start_after:
            kwargs["StartAfter"] = self.prefix + start_after
        try:
            yield from self._client.get_paginator("list_objects_v2").paginate(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._unavailable(prefix, exc) from exc

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        if prefix:
            check_key(prefix)
        cut = len(self.prefix)
        for page in self._pages(prefix, start_after):
            for obj in page.get("Contents", []):
                yield ObjectStat(obj["Key"][cut:], obj["Size"], obj["ETag"], obj["LastModified"].timestamp())

    def list_dirs(self, prefix: str) -> list[str]:
        if prefix:
            check_key(prefix)
        start = len(self.prefix + prefix)
        return sorted(p["Prefix"][start:].rstrip("/") for page in self._pages(prefix) for p in page.get("CommonPrefixes", []))

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._unavailable(key, exc) from exc

    def presign(self, key: str, method: str, expires_s: int) -> str | None:
        op = {"GET": "get_object", "PUT": "put_object"}[method]
        return self._client.generate_presigned_url(op, Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s)

    def check(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError) as exc:
            raise self._unavailable("", exc) from exc
