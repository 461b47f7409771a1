"""The model checked against a real run of the same code at small scale (runs in the operator's process; starts
one bulletin subprocess on loopback over a temporary folder store).

``fetchers`` replicas, each with its own :class:`~stitchboard.bulletin.client.BulletinClient` (the sidecar's
Fetcher downloads each file with :meth:`~stitchboard.bulletin.client.BulletinClient.download_blob`, which is what
runs here), download the same ``blobs`` files of ``blob_bytes`` each at once, one file at a time, from a real
bulletin (one process, its own store). First one fetcher alone measures the per-part figures: the bulletin's CPU
per blob GET (its process's CPU seconds, ``/proc``) and the fetcher's CPU per blob (download and sha256 check).
Then the concurrent run is made; :class:`~.model.StepModel` predicts it from the lone fetcher's figures alone
(no figure is taken from the concurrent run). The ratio is simulated over measured time to the last fetcher.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stitchboard.bulletin.client import BulletinClient

from ..processes import ProcessGroup, free_port
from .figures import Fleet
from .model import Scenario, StepModel, StepResult

RUN = "simulate-validation"
#: Download threads of the lone fetcher's calibration: the sidecar Fetcher's own (its ``concurrency`` default).
FETCH_THREADS = 4


@dataclass(frozen=True)
class Validation:
    """One validation run.

    Attributes:
        fetchers, blobs, blob_bytes: its size.
        server_s_per_get: the bulletin's CPU seconds per blob GET (measured alone).
        client_s_per_get: one fetcher's CPU seconds per blob (measured alone).
        wall_s_per_get: the lone fetcher's wall seconds per blob (its download threads overlapping).
        measured_t50_s, measured_t100_s: time to half and all of the fetchers done, seconds (the real run).
        simulated_t50_s, simulated_t100_s: the model's.
    """

    fetchers: int
    blobs: int
    blob_bytes: int
    server_s_per_get: float
    client_s_per_get: float
    wall_s_per_get: float
    measured_t50_s: float
    measured_t100_s: float
    simulated_t50_s: float
    simulated_t100_s: float

    @property
    def ratio(self) -> float:
        """Simulated over measured, of the two times the one farther from 1."""
        ratios = [self.simulated_t50_s / self.measured_t50_s, self.simulated_t100_s / self.measured_t100_s]
        return max(ratios, key=lambda r: abs(r - 1.0))


def sha256_Bps(size_bytes: int = 64 << 20) -> float:
    """Bytes per second hashlib.sha256 checks on this host (the sidecar's check of each downloaded file)."""
    data = os.urandom(size_bytes)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return size_bytes / (time.perf_counter() - start)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def simulated(
    fetchers: int, blobs: int, blob_bytes: int, server_s: float, client_s: float, wall_s: float = 0.0
) -> StepResult:
    """The model of the validation run: every fetcher and the bulletin on this host, sharing its CPU.

    Per blob GET the bulletin spends ``server_s`` of CPU on its event loop (first come first served: the answer is
    one chunk), then the fetcher ``client_s`` (download and sha256 check), its downloads interleaving with the
    other fetchers' (threads of one process, one interpreter). Both processes share one core (the 2-core test
    host, shared with other jobs, gives the run about one core: an assumption this validation checks). Where the
    lone fetcher's wall time per blob, ``wall_s``, is longer than both CPU figures together (other jobs holding the
    cores stretch it), both are stretched by that factor.
    """
    stretch = max(1.0, wall_s / (server_s + client_s))
    fleet = Fleet().with_values(
        parameters=blobs * blob_bytes,
        changed_fraction=1.0,
        bytes_per_changed_cond=1.0,
        trainer_ranks=blobs,
        replicas=fetchers,
        regions=1,
        bulletin_processes=1,
        poll_answer_s=0.0,
        control_requests=0,
        bulletin_request_s=server_s * stretch,
        store_get_rate=float("inf"),
        store_stream_Bps=float("inf"),
        single_flow_Bps=float("inf"),
        origin_Bps=float("inf"),
        replicas_per_host=fetchers,
        host_cores=1,
        bulletin_on_replica_host=1,
        verify_Bps=blob_bytes / (client_s * stretch),
        fetch_concurrency=1,
        decode_cond_per_s=float("inf"),
        pause_fixed_s=0.0,
        pause_s_per_element=0.0,
    )
    return StepModel(Scenario(fleet, "cond", cache=False)).run()


def _download_all(client: BulletinClient, shas: list[str], size: int, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for sha in shas:
        path = client.download_blob(RUN, sha, folder / sha, expected_size=size)
        path.unlink()


def validate(
    fetchers: int = 100, blobs: int = 2, blob_bytes: int = 1 << 20, solo_rounds: int = 50, repeats: int = 3
) -> Validation:
    """Measure the per-part figures alone, predict the concurrent run with the model, run it, compare.

    The calibration and the concurrent run are made ``repeats`` times, in turn, and each figure is the median of
    its repeats (the host is shared: a lone measurement can catch another job's burst).

    Args:
        fetchers: concurrent fetchers (threads, each its own client).
        blobs: files each fetcher downloads, one at a time.
        blob_bytes: size of each file, bytes.
        solo_rounds: rounds of the lone fetcher's calibration (its CPU clock counts in 10 ms ticks: keep 50+).
        repeats: calibrations and concurrent runs.

    Raises:
        DemoError: the bulletin did not start (with its log's tail).
        BulletinError: a download failed (every download is verified by its sha256).
    """
    server, client_cpu, wall, t50, t100 = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="stitch-simulate-") as tmp:
        root = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with ProcessGroup(root / "logs") as procs:
            bulletin = procs.start(
                "bulletin",
                [
                    sys.executable,
                    "-c",
                    "from stitchboard.proto.cli import main; main()",
                    "bulletin",
                    "serve",
                    "--port",
                    str(port),
                ],
                f"{url}/healthz",
                env={"STITCH_BULLETIN_STORE": f"file://{root / 'store'}", "STITCH_BULLETIN_LOG_LEVEL": "error"},
            )
            bulletin.wait_healthy(60)
            proc = bulletin.proc
            datas = [os.urandom(blob_bytes) for _ in range(blobs)]
            shas = [hashlib.sha256(d).hexdigest() for d in datas]
            with BulletinClient(url) as client:
                for sha, data in zip(shas, datas, strict=True):
                    client.put_blob(RUN, sha, data)
                _download_all(client, shas, blob_bytes, root)  # warm: connections, the store's caches
                for repeat in range(repeats):
                    server0, client0, wall0 = _cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
                    with ThreadPoolExecutor(FETCH_THREADS) as pool:
                        list(
                            pool.map(
                                lambda i: _download_all(client, shas, blob_bytes, root / f"s{i}"), range(solo_rounds)
                            )
                        )
                    server.append((_cpu_seconds(proc.pid) - server0) / (solo_rounds * blobs))
                    client_cpu.append((time.process_time() - client0) / (solo_rounds * blobs))
                    wall.append((time.perf_counter() - wall0) / (solo_rounds * blobs))
                    done = sorted(_concurrent(url, fetchers, shas, blob_bytes, root / f"run{repeat}"))
                    t50.append(done[(len(done) + 1) // 2 - 1])
                    t100.append(done[-1])
    server_s, client_s, wall_s = statistics.median(server), statistics.median(client_cpu), statistics.median(wall)
    model = simulated(fetchers, blobs, blob_bytes, server_s, client_s, wall_s)
    return Validation(
        fetchers,
        blobs,
        blob_bytes,
        server_s,
        client_s,
        wall_s,
        measured_t50_s=statistics.median(t50),
        measured_t100_s=statistics.median(t100),
        simulated_t50_s=model.time_to(0.5),
        simulated_t100_s=model.time_to(1.0),
    )


def _concurrent(url: str, fetchers: int, shas: list[str], size: int, root: Path) -> list[float]:
    """Seconds from the start to each fetcher's last verified file (a failed fetcher's error is raised)."""
    clients = [BulletinClient(url) for _ in range(fetchers)]
    start = threading.Barrier(fetchers + 1)
    t0 = [0.0]

    def fetcher(i: int) -> float:
        folder = root / f"f{i}"
        folder.mkdir(parents=True)
        start.wait()
        _download_all(clients[i], shas, size, folder)
        return time.perf_counter() - t0[0]

    try:
        with ThreadPoolExecutor(fetchers) as pool:
            futures = [pool.submit(fetcher, i) for i in range(fetchers)]
            t0[0] = time.perf_counter()
            start.wait()
            return [f.result() for f in futures]
    finally:
        for c in clients:
            c.close()
