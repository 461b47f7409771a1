"""Benchmark of the status page at scale (prints figures; not a test).

1. The page's render (:func:`stitchboard.bulletin.page._render`: both plots and the HTML) for a
   synthetic run of 200 versions whose replicas each hold 32 applied versions in their history,
   at ``--replicas`` sizes: the best of ``--repeat`` runs each, and the ratio of the largest to
   the 100-replica time (the test asserts the work ratio 1,000 vs 100 <= 15x).
2. ``GET /status/runs/{run}`` over HTTP from a bulletin on loopback (a local-folder store) holding
   ``--versions`` published versions and ``--page-replicas`` replica records written to the
   store: the first answer (the records read from the store) and the best of the next ones.

Run: ``python -m tests.benchmarks.bench_page [--replicas 10 100 1000] [--page-replicas 1000]``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx

from stitchboard.bulletin import page
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.fleet import ReplicaReport
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.bulletin.fleet_helpers import synthetic_fleet
from tests.sidecar.sidecar_helpers import Publisher, make_view


def render_s(replicas: int, repeat: int) -> tuple[float, int]:
    """Best seconds of ``repeat`` renders of a ``replicas``-replica run, and the page's size, bytes."""
    view, versions = synthetic_fleet(replicas)
    changed = {v.version: 0.5 for v in versions}
    best, size = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        html = page._render("bench", view, versions, changed, True)
        best, size = min(best, time.perf_counter() - t0), len(html.encode())
    return best, size


def page_over_http(replicas: int, versions: int, repeat: int) -> tuple[float, float, int]:
    """Seconds of the first ``GET /status/runs/{run}`` and the best of ``repeat`` more, and the answer's size."""
    with tempfile.TemporaryDirectory() as folder:
        server = ThreadServer(BulletinSettings(store=f"file://{folder}/store", max_live_replicas=replicas))
        try:
            run = f"bench-{uuid.uuid4().hex[:6]}"
            with server.client() as client:
                pub = Publisher(client, run, Path(folder))
                pub.publish(make_view(0, tensors=2, numel=1024))
                for v in range(1, versions):
                    pub.step(v)
                infos = client.versions(run)
            committed = [
                (i.version, datetime.fromisoformat(i.committed_at).timestamp()) for i in infos if i.committed_at
            ]
            rng = random.Random(0)
            fleet = server.app.state.bulletin.fleet.fleet
            for i in range(replicas):
                history = [(v, at + rng.uniform(0.01, 0.5)) for v, at in committed[-32:]]
                fleet.write(
                    run,
                    ReplicaReport(
                        replica_id=f"pod-{i:05d}", engine="vllm", applied_version=history[-1][0],
                        target_version=history[-1][0], state="idle", lag_versions=0, healthy=True,
                        history=history, started_at=committed[0][1],
                    ),
                )  # fmt: skip
            url = f"{server.url}/status/runs/{run}"
            t0 = time.perf_counter()
            answer = httpx.get(url, timeout=600)
            first = time.perf_counter() - t0
            assert answer.status_code == 200 and answer.text.count('class="replica') == replicas, answer.text[:300]
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                httpx.get(url, timeout=600).raise_for_status()
                best = min(best, time.perf_counter() - t0)
            return first, best, len(answer.content)
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--page-replicas", type=int, default=1000)
    ap.add_argument("--versions", type=int, default=40)
    args = ap.parse_args()

    print("status page benchmark: a run of 200 versions, each replica's history 32 applied versions")
    times = {}
    for n in args.replicas:
        times[n], size = render_s(n, args.repeat)
        print(f"  render, {n:>6,} replicas: {times[n]:.3f} s (best of {args.repeat}), {size / 1e3:,.0f} kB")
    if 100 in times and max(times) != 100:
        print(f"  ratio {max(times):,} vs 100 replicas: {times[max(times)] / times[100]:.2f}x")
    first, best, size = page_over_http(args.page_replicas, args.versions, args.repeat)
    print(
        f"  GET /status/runs/{{run}} over HTTP, {args.page_replicas:,} replica records and {args.versions} versions "
        f"in a local-folder store: first {first:.3f} s (records read), then {best:.3f} s (best of {args.repeat}), "
        f"{size / 1e3:,.0f} kB"
    )


if __name__ == "__main__":
    main()
