"""A real S3 server for tests: Ceph's radosgw on a one-node cluster in a temp folder (fixture :func:`radosgw`).

Runs in the pytest process, which starts three daemons from Debian's packages (``apt-get install
-y --no-install-recommends radosgw ceph-mon ceph-osd``; ``make venv`` installs them): one monitor,
one OSD on memstore (objects live in the OSD's memory) and radosgw, with no manager, cephx off
(``auth ... = none``), pools of size 1, on free loopback ports. moto stays the fast S3 of the
suite; this one judges what moto cannot: signatures of presigned URLs, payload digests,
conditional writes under races.

What a start needs (each one learned from a failure; docs/reference/storage.md lists what
radosgw 16 does and does not do as an S3 server):

* ``osd crush update on start`` / ``osd class update on start`` off, and the OSD registered
  (``osd new`` with the uuid its ``--mkfs`` got) and put in the crush map here: else the OSD
  dies with EPERM "wrong fsid" in about one start of three, or never boots;
* ``ms mon client mode = crc``: radosgw defaults its monitor connection to mode ``secure``,
  which auth ``none`` cannot give (the connection is refused with -13, EACCES, forever);
* ``paxos propose interval = 0.01``: each monitor command otherwise waits up to a second;
* the seven RGW pools created before radosgw starts (it would create them with defaults);
* ``tcp_nodelay=1`` on the beast frontend: else each GET stalls 40 ms (Nagle + delayed ACK);
* SIGKILL to stop (SIGTERM takes ~7 s); the folder is removed after.

A start takes ~2 s on two cores (measured: :attr:`RadosGW.start_s`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from stitchboard.demo.processes import free_port

#: The programs a start runs (all from Debian's ``radosgw``, ``ceph-mon``, ``ceph-osd`` and their dependencies).
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
INSTALL_HINT = "apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd (`make venv` runs it as root)"
#: The pools radosgw uses with its default zone, created (8 placement groups each) before it starts.
RGW_POOLS = (
    ".rgw.root",
    "default.rgw.control",
    "default.rgw.meta",
    "default.rgw.log",
    "default.rgw.buckets.index",
    "default.rgw.buckets.data",
    "default.rgw.buckets.non-ec",
)
START_TIMEOUT_S = 120.0

_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
keyring = /dev/null
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
osd crush update on start = false
osd class update on start = false
paxos propose interval = 0.01
ms bind ipv6 = false
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
[mon.a]
mon data = {root}/mon
[osd.0]
osd data = {root}/osd
osd objectstore = memstore
[client.rgw]
rgw data = {root}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
"""


def missing_binaries() -> list[str]:
    """The programs of :data:`BINARIES` not on ``PATH`` (empty when radosgw can start here)."""
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class RadosGW:
    """A running one-node Ceph cluster with radosgw, and an S3 user on it.

    Attributes:
        endpoint: radosgw's URL, ``http://127.0.0.1:<port>`` (path-style addressing).
        access_key_id, secret_access_key: the S3 user's keys (SigV2 and SigV4 both check them).
        region: the region to sign for (radosgw's default zone group accepts ``us-east-1``).
        root: the temp folder (config, monitor store, logs, sockets), removed by :meth:`stop`.
        start_s: seconds from the first command to the first answer over HTTP.
    """

    endpoint: str
    access_key_id: str
    secret_access_key: str
    root: Path
    region: str = "us-east-1"
    start_s: float = 0.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (path-style; ``config``: more :class:`botocore.config.Config` fields)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, **config),
        )

    def create_bucket(self) -> str:
        """A new, empty bucket; returns its name."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of one daemon's log (``mon.a``, ``osd.0``, ``client.rgw``), for error messages."""
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"

    def stop(self) -> None:
        """SIGKILL every daemon, wait for each, and remove the folder."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(30)
        shutil.rmtree(self.root, ignore_errors=True)


def start_radosgw(root: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> RadosGW:
    """Start a one-node cluster and radosgw in ``root`` (a new temp folder when None);
    stop it with :meth:`RadosGW.stop`.

    Raises:
        FileNotFoundError: a program of :data:`BINARIES` is not installed (see :data:`INSTALL_HINT`).
        RuntimeError: a step failed, or radosgw did not answer within ``timeout_s`` seconds (the
            message holds the daemons' log tails); everything started is stopped and the folder removed.
    """
    if missing := missing_binaries():
        raise FileNotFoundError(f"radosgw cannot start: {', '.join(missing)} not installed; {INSTALL_HINT}")
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="stitch-radosgw-")) if root is None else root
    rgw = RadosGW(
        endpoint=f"http://127.0.0.1:{free_port()}",
        access_key_id=f"AK{uuid.uuid4().hex[:18].upper()}",
        secret_access_key=uuid.uuid4().hex + uuid.uuid4().hex[:8],
        root=root,
    )
    try:
        _start(rgw, started + timeout_s)
    except BaseException:
        rgw.stop()
        raise
    rgw.start_s = time.monotonic() - started
    return rgw


def _start(rgw: RadosGW, deadline: float) -> None:
    root, fsid, osd_uuid = rgw.root, str(uuid.uuid4()), str(uuid.uuid4())
    for sub in ("run", "log", "mon", "osd", "rgw"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "ceph.conf"
    mon_port = free_port()
    conf.write_text(_CONF.format(fsid=fsid, mon_port=mon_port, root=root, rgw_port=rgw.endpoint.rsplit(":", 1)[1]))
    c = ["-c", str(conf)]

    def run(*cmd: str, stdin: str | None = None) -> str:
        left = max(1.0, deadline - time.monotonic())
        try:
            done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"radosgw start: {' '.join(cmd)} did not finish in {left:.0f} s; {_tails(rgw)}"
            ) from None
        if done.returncode != 0:
            raise RuntimeError(f"radosgw start: {' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def daemon(name: str, *cmd: str) -> None:
        with open(root / "log" / f"{name}.out", "wb") as out:
            rgw.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", "--fsid", fsid, str(root / "monmap"))
    run("ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", str(root / "monmap"))
    run("ceph-osd", *c, "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, "--no-mon-config")  # the monitor is not up yet
    daemon("mon", "ceph-mon", *c, "-i", "a", "-f")
    # One `ceph` process for every monitor command (its interactive mode reads them from stdin;
    # it exits 0 even when one fails, so the result is checked below).
    commands = [f"osd new {osd_uuid} 0", "osd crush add osd.0 1.0 host=localhost root=default"]
    commands += [f"osd pool create {pool} 8 8" for pool in RGW_POOLS]
    run("ceph", *c, "--connect-timeout", "60", stdin="\n".join(commands) + "\n")
    osdmap = json.loads(run("ceph", *c, "osd", "dump", "--format", "json"))
    pools = {p["pool_name"] for p in osdmap["pools"]}
    if [o.get("uuid") for o in osdmap["osds"]] != [osd_uuid] or not pools >= set(RGW_POOLS):
        raise RuntimeError(f"radosgw start: the monitor did not take the OSD or the pools: {osdmap}")
    daemon("osd", "ceph-osd", *c, "-i", "0", "-f")
    daemon("rgw", "radosgw", *c, "-n", "client.rgw", "-f")
    # Waits until the OSD is up and its placement groups are active (a RADOS write).
    run(
        "radosgw-admin", *c, "-n", "client.rgw", "user", "create", "--uid", "stitch", "--display-name", "stitch",
        "--access-key", rgw.access_key_id, "--secret", rgw.secret_access_key,
    )  # fmt: skip
    while True:
        for name, proc in rgw.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"radosgw start: {name} exited ({proc.returncode}); {_tails(rgw)}")
        try:
            if httpx.get(rgw.endpoint, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"radosgw start: no answer from {rgw.endpoint}; {_tails(rgw)}")
        time.sleep(0.05)


def _tails(rgw: RadosGW) -> str:
    return " | ".join(f"{name}: {rgw.log_tail(name, 1500)}" for name in ("mon.a", "osd.0", "client.rgw"))


@pytest.fixture(scope="session")
def radosgw() -> Iterator[RadosGW]:
    """A real S3 server (Ceph radosgw 16) for the session; skipped where radosgw is not installed."""
    if missing := missing_binaries():
        pytest.skip(f"radosgw is not installed here ({', '.join(missing)} missing): {INSTALL_HINT}")
    rgw = start_radosgw()
    try:
        yield rgw
    finally:
        rgw.stop()
