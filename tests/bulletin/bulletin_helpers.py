"""Helpers for the bulletin tests: live servers on loopback, manifests, store snapshots."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.http_protocol import CoalescingHttpToolsProtocol
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.demo.processes import free_port
from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats
from tests.support.app_server import AppServer

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class ThreadServer(AppServer):
    """A bulletin app (``self.app``) served by uvicorn in a thread of this process, on a free loopback
    port, with the HTTP protocol ``stitchboard bulletin serve`` uses."""

    def __init__(self, settings: BulletinSettings) -> None:
        self.app = create_app(settings)
        super().__init__(self.app, graceful_shutdown_s=1, http=CoalescingHttpToolsProtocol)
        self._clients: list[BulletinClient] = []

    def client(self, token: str | None = None, **kwargs) -> BulletinClient:
        """A client of this server; :meth:`close_clients` (or :meth:`stop`) closes it and its connections."""
        client = BulletinClient(
            self.url, token, retries=kwargs.pop("retries", 1), backoff_s=kwargs.pop("backoff_s", 0.01), **kwargs
        )
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        """Close the clients :meth:`client` made (their pooled sockets would otherwise leak)."""
        while self._clients:
            self._clients.pop().close()

    def stop(self) -> None:
        self.close_clients()
        super().stop()


class ProcessServer:
    """``stitchboard bulletin serve`` in a subprocess (for race and kill/restart tests)."""

    def __init__(self, settings: BulletinSettings) -> None:
        self.port = free_port()  # below the ephemeral range: no other process's own socket takes it first
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **S3_ENV}
        for name, value in settings.model_dump(exclude={"tokens", "host", "port"}).items():
            if value is not None:
                env[f"STITCH_BULLETIN_{name.upper()}"] = str(value)
        env["STITCH_BULLETIN_LOG_LEVEL"] = "warning"
        cmd = [
            sys.executable,
            "-c",
            "from stitchboard.proto.cli import main; main()",
            "bulletin",
            "serve",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 180  # a loaded machine can take tens of seconds to start the CLI
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "bulletin subprocess did not start: "
                    f"{self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ''}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, like a crash."""
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()


@dataclass
class Backend:
    """One store the API suite runs against."""

    name: str
    settings: BulletinSettings
    root: Path | None = None  # file store folder
    bucket: str | None = None  # S3 bucket

    def keys(self) -> dict[str, str]:
        """Every object key -> a content fingerprint (to check that a failed request changed nothing)."""
        if self.root is not None:
            out = {}
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for f in filenames:
                    if not f.startswith("."):
                        p = Path(dirpath) / f
                        out[str(p.relative_to(self.root))] = hashlib.sha256(p.read_bytes()).hexdigest()
            return out
        s3 = boto3.client(
            "s3",
            endpoint_url=self.settings.s3_endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        out = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for o in page.get("Contents", []):
                out[o["Key"]] = o["ETag"]
        return out


#: Small limits so the size-limit tests stay fast.
TEST_LIMITS = {"max_blob_bytes": 256 * 1024, "max_manifest_bytes": 64 * 1024, "poll_interval_s": 0.1}


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path, **overrides) -> Backend:
    """A fresh, empty store of ``kind`` ("file" or "s3") with test settings."""
    limits = {**TEST_LIMITS, **overrides}
    if kind == "file":
        root = tmp_path / "store"
        return Backend("file", BulletinSettings(store=f"file://{root}", **limits), root=root)
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"b-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    settings = BulletinSettings(
        store=f"s3://{bucket}/stitch",
        s3_endpoint_url=endpoint,
        s3_region="us-east-1",
        s3_addressing_style="path",
        **limits,
    )
    return Backend("s3", settings, bucket=bucket)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_manifest(
    run: str, version: int, files: list[FileRef], *, snapshot: bool | None = None, metadata: dict | None = None
) -> VersionManifest:
    """A valid manifest over ``files`` (stats derived from them)."""
    tensor = TensorSpec(name="model.w", dtype="BF16", shape=[8], checksums={"xxh3_128": f"{version:032x}"})
    return VersionManifest(
        run_id=run,
        version=version,
        base_version=None if version == 0 else version - 1,
        snapshot=any(f.role == "snapshot" for f in files) if snapshot is None else snapshot,
        tensors=[tensor],
        files=files,
        stats=VersionStats(
            changed_elements=0 if version == 0 else 1,
            total_elements=8,
            encoded_bytes=sum(f.size_bytes for f in files if f.role == "patch"),
        ),
        metadata=metadata or {},
    )


def upload_version(
    client: BulletinClient,
    run: str,
    version: int,
    *,
    snapshot_bytes: int = 0,
    patch_bytes: int = 0,
    publish: bool = True,
    metadata: dict | None = None,
) -> VersionManifest:
    """Upload random files for one version (a snapshot shard and/or a patch) and publish it."""
    files = []
    for role, size in (("snapshot", snapshot_bytes), ("patch", patch_bytes)):
        if size or (role == "snapshot" and version == 0):
            data = os.urandom(max(size, 1))
            client.put_blob(run, sha(data), data)
            files.append(
                FileRef(path=f"{role}-{version}.safetensors", sha256=sha(data), size_bytes=len(data), role=role)
            )
    manifest = make_manifest(run, version, files, metadata=metadata)
    if publish:
        client.publish(manifest)
    return manifest
