"""bench_relay at a small size: it runs end to end (a bulletin process, nginx, fetcher processes), its figures add up
(through the relay one origin GET per blob, direct one per fetcher and blob, every fetch verified) and its last line
is the issue's. Skipped, saying why, only where nginx is not installed."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks import bench_relay
from tests.bulletin.relay_nginx import NGINX, NO_NGINX

#: Starts nginx and processes of its own (docs/testing.md, the slow tier).
pytestmark = [pytest.mark.skipif(NGINX is None, reason=NO_NGINX), pytest.mark.slow]


def test_bench_relay_counts_one_origin_get_per_blob_through_the_relay(capsys) -> None:
    assert bench_relay.main(["--fetchers", "6", "--blobs", "3", "--blob-bytes", "65536", "--processes", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"relay: fetchers=6 blobs=3 origin_gets_per_blob=1\.00 verified=18/18", lines[-1]), lines[-1]
    direct = next(line for line in lines if line.strip().startswith("direct"))
    assert "origin GETs 18 (6.00 per blob), verified 18/18" in direct
