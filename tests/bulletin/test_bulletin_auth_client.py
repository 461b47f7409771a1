"""Auth scopes, presigned S3 transfers, the versions CLI and the client's retry rules."""

from __future__ import annotations

import json
import os
import warnings

import httpx
import pytest
import typer
from typer.testing import CliRunner

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import (
    ForbiddenError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
    VersionConflictError,
)
from stitchboard.bulletin.settings import TokenGrant
from stitchboard.bulletin.versions_cli import app as versions_cli
from stitchboard.proto.cli import build_app
from stitchboard.proto.env import LegacyEnvWarning
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, make_manifest, sha, upload_version

TOKENS = {
    "pub": TokenGrant(scopes=["publish"]),
    "reader": TokenGrant(scopes=["read"]),
    "pub-a": TokenGrant(scopes=["publish"], runs=["run-a"]),
}


@pytest.fixture
def secured(request, tmp_path):
    backend = make_backend("file", request, tmp_path, tokens=TOKENS)
    srv = ThreadServer(backend.settings)
    yield srv
    srv.stop()


def test_tokens_and_scopes(secured):
    with (
        secured.client("pub") as pub,
        secured.client("reader") as reader,
        secured.client("pub-a") as pub_a,
        secured.client() as anon,
        secured.client("nope") as wrong,
    ):
        upload_version(pub, "run-b", 0, snapshot_bytes=10)
        assert reader.latest("run-b") == 0
        assert pub.latest("run-b") == 0  # publish implies read
        with pytest.raises(UnauthorizedError):
            anon.latest("run-b")
        with pytest.raises(UnauthorizedError, match="unknown bearer token"):
            wrong.latest("run-b")
        with pytest.raises(ForbiddenError, match="needs 'publish'"):
            reader.put_blob("run-b", sha(b"x"), b"x")
        with pytest.raises(ForbiddenError, match="not valid for run 'run-b'"):
            pub_a.latest("run-b")
        upload_version(pub_a, "run-a", 0, snapshot_bytes=10)
        assert [r.run_id for r in pub_a.runs()] == ["run-a"]
        assert {r.run_id for r in reader.runs()} == {"run-a", "run-b"}
    r = httpx.get(f"{secured.url}/v1/runs/run-b/versions/latest")
    assert r.status_code == 401 and r.json()["type"] == "Unauthorized"
    assert httpx.get(f"{secured.url}/healthz").status_code == 200


def test_presigned_uploads_and_downloads_bypass_the_bulletin(request, tmp_path, run):
    backend = make_backend("s3", request, tmp_path, presign=True)
    srv = ThreadServer(backend.settings)
    try:
        with srv.client() as c:
            data = os.urandom(50_000)
            assert c.put_blob(run, sha(data), data)
            assert c._presign is True  # went to the presigned URL
            upload_version(c, run, 0, snapshot_bytes=10)
            r = httpx.get(f"{srv.url}/v1/runs/{run}/blobs/{sha(data)}")
            assert r.status_code == 307 and backend.settings.s3_endpoint_url in r.headers["location"]
            assert c.download_blob(run, sha(data), tmp_path / "d").read_bytes() == data
    finally:
        srv.stop()


def test_versions_cli(server, client, run):
    upload_version(client, run, 0, snapshot_bytes=100)
    upload_version(client, run, 1, patch_bytes=10)
    cli = CliRunner()
    common = ["--bulletin", server.url, "--run", run]
    out = cli.invoke(versions_cli, ["latest", *common, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["version"] == 1
    out = cli.invoke(versions_cli, ["list", *common, "--json"])
    assert [v["version"] for v in json.loads(out.output)] == [0, 1]
    out = cli.invoke(versions_cli, ["show", *common, "--version", "1", "--json"])
    assert json.loads(out.output)["version"] == 1
    out = cli.invoke(versions_cli, ["plan", *common, "--from", "0", "--json"])
    assert json.loads(out.output)["steps"][0]["kind"] == "delta"
    out = cli.invoke(versions_cli, ["list", *common])
    assert out.exit_code == 0 and "snapshot" in out.output
    out = cli.invoke(versions_cli, ["latest", *common, "--after", "1"])
    assert out.exit_code == 3
    out = cli.invoke(versions_cli, ["show", *common, "--version", "5"])
    assert out.exit_code == 1 and "NotFound" in out.output


def test_client_clis_read_the_client_variables_and_their_legacy_names(secured):
    """--bulletin/--token come from STITCH_CLIENT_*; the legacy STITCH_BULLETIN_URL/STITCH_TOKEN still work,
    with a warning; new names and flags win."""
    with secured.client("pub") as pub:
        upload_version(pub, "env-run", 0, snapshot_bytes=10)
    cli = CliRunner()
    args = ["latest", "--run", "env-run", "--json"]
    unset = dict.fromkeys(("STITCH_CLIENT_BULLETIN", "STITCH_CLIENT_TOKEN", "STITCH_BULLETIN_URL", "STITCH_TOKEN"))
    with pytest.warns(LegacyEnvWarning) as caught:
        out = cli.invoke(
            versions_cli, args, env={**unset, "STITCH_BULLETIN_URL": secured.url, "STITCH_TOKEN": "reader"}
        )
    assert out.exit_code == 0 and json.loads(out.output)["version"] == 0, out.output
    assert sorted(str(w.message).split()[0] for w in caught) == ["STITCH_BULLETIN_URL", "STITCH_TOKEN"]
    legacy_wrong = {"STITCH_BULLETIN_URL": "http://127.0.0.1:9", "STITCH_TOKEN": "nope"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cli.invoke(
            versions_cli,
            args,
            env={**unset, **legacy_wrong, "STITCH_CLIENT_BULLETIN": secured.url, "STITCH_CLIENT_TOKEN": "reader"},
        )
        assert out.exit_code == 0 and json.loads(out.output)["version"] == 0, out.output
        out = cli.invoke(
            versions_cli, [*args, "--bulletin", secured.url, "--token", "reader"], env={**unset, **legacy_wrong}
        )
        assert out.exit_code == 0 and json.loads(out.output)["version"] == 0, out.output
    assert not [w for w in caught if issubclass(w.category, LegacyEnvWarning)]
    # One declaration of both options, in every client command.
    root = typer.main.get_command(build_app())
    for path in (["versions", "latest"], ["versions", "plan"], ["publish"], ["pull"]):
        cmd = root
        for part in path:
            cmd = cmd.commands[part]
        envvars = {p.name: p.envvar for p in cmd.params if p.name in ("bulletin", "token")}
        assert envvars == {
            "bulletin": ["STITCH_CLIENT_BULLETIN", "STITCH_BULLETIN_URL"],
            "token": ["STITCH_CLIENT_TOKEN", "STITCH_TOKEN"],
        }, path


def _scripted(answers: list[httpx.Response | Exception]):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handler), calls


def test_client_retries_5xx_and_transport_errors_but_never_4xx():
    ok = httpx.Response(200, json={"run_id": "r", "version": 3, "snapshot": False, "manifest_sha256": "0" * 64})
    transport, calls = _scripted(
        [httpx.Response(503, json={"type": "Unavailable", "message": "busy"}), httpx.ConnectError("refused"), ok]
    )
    assert BulletinClient("http://b", retries=3, backoff_s=0.001, transport=transport).latest("r") == 3
    assert len(calls) == 3

    transport, calls = _scripted([httpx.Response(409, json={"type": "VersionConflict", "message": "taken"})])
    with pytest.raises(VersionConflictError, match="taken"):
        BulletinClient("http://b", retries=3, backoff_s=0.001, transport=transport).publish(make_manifest("r", 1, []))
    assert len(calls) == 1

    transport, calls = _scripted([httpx.Response(404, text="plain proxy page")])
    with pytest.raises(NotFoundError):
        BulletinClient("http://b", retries=3, backoff_s=0.001, transport=transport).manifest("r", 1)
    assert len(calls) == 1

    transport, calls = _scripted([httpx.Response(502, text="bad gateway")])
    with pytest.raises(UnavailableError):
        BulletinClient("http://b", retries=2, backoff_s=0.001, transport=transport).runs()
    assert len(calls) == 3


def test_client_reports_an_unreachable_bulletin():
    from tests.bulletin.bulletin_helpers import free_port

    port = free_port()  # nothing listens on it
    with pytest.raises(UnavailableError, match="unreachable after 2 attempts"):
        BulletinClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.001).latest("r")


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
def test_client_and_versions_cli_do_not_import_fastapi():
    import subprocess
    import sys

    code = (
        "import sys, stitchboard.bulletin.client, stitchboard.bulletin.versions_cli; "
        "bad = {'fastapi', 'starlette', 'uvicorn', 'boto3'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
