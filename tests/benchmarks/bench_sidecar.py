"""Benchmark: publish -> applied latency of a sidecar over loopback (prints figures; not a test).

A bulletin runs as a subprocess (``stitchboard bulletin serve`` over a local-folder store); a
sidecar and the fake engine of the tests (patches really applied with the codec, answers over
HTTP) run in this process. Each step mutates ``--fraction`` of every tensor of a BF16 view,
uploads the patch, then times from the publish call (the manifest commit) until

* **applied**: the sidecar's gate reports the version (polled every 1 ms), and
* **served**: a request sent before the publish with ``X-Stitch-Min-Version: v`` is answered.

Run: ``python -m tests.benchmarks.bench_sidecar [--steps 20] [--tensors 32] [--numel 262144]``.
Target: applied p50 <= 1 s.

With a real engine: start vLLM on ``--checkpoint DIR`` (a bf16 safetensors checkpoint) with the
stitchboard worker extension and ``VLLM_SERVER_DEV_MODE=1``, then pass ``--engine-url URL
--checkpoint DIR``: version 0 is that checkpoint (the engine's boot version; an engine that
already records a version, e.g. from an earlier run, gets the checkpoint loaded back as version 0)
and each step changes the lowest bits of ``--fraction`` of every tensor.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.processes import free_port
from stitchboard.proto.checkpoint import checkpoint_files, load_checkpoint
from stitchboard.proto.schema import VersionManifest
from stitchboard.sidecar.app import create_app
from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.sidecar.settings import SidecarSettings
from tests.benchmarks.bench_bulletin import start_bulletin
from tests.sidecar.fake_engine import FakeEngine, copy_view
from tests.sidecar.sidecar_helpers import AppServer, Publisher, make_view, mutate

RUN = "bench-sidecar"


def _boot_at_version_0(engine: VllmEngine, checkpoint: str, manifest: VersionManifest) -> None:
    """Make a used engine hold ``checkpoint`` as version 0 again (a fresh one records none and is left as it is)."""
    if (engine.state().version, engine.state().phase) == (None, "idle"):
        return
    weight_map, where = checkpoint_files(checkpoint)
    shards = sorted({str(where / f) for f in weight_map.values()}) if weight_map else [str(where)]
    engine.pause()
    try:
        engine.load_snapshot(shards, 0, manifest.checksums())
        engine.reset_prefix_cache()
    finally:
        engine.resume()


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--numel", type=int, default=262144, help="elements per tensor (BF16)")
    parser.add_argument("--fraction", type=float, default=0.01, help="fraction of elements changed per step")
    parser.add_argument(
        "--engine-url", help="a real vLLM (with the stitchboard worker extension) instead of the fake engine"
    )
    parser.add_argument("--checkpoint", help="with --engine-url: the checkpoint folder the engine serves (version 0)")
    args = parser.parse_args()
    if bool(args.engine_url) != bool(args.checkpoint):
        parser.error("--engine-url and --checkpoint go together")

    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as tmp:
        port = free_port()
        bulletin = start_bulletin(f"file://{tmp}/store", port, "critical")  # quiet about the long-poll cut at exit
        url = f"http://127.0.0.1:{port}"
        client = BulletinClient(url)
        publisher = Publisher(client, RUN, Path(tmp))
        if args.engine_url:
            view = copy_view(load_checkpoint(args.checkpoint))
            engine, engine_server = VllmEngine(args.engine_url), None
            settings = SidecarSettings(
                bulletin=url,
                run=RUN,
                engine_url=args.engine_url,
                boot_version=0,
                handoff_dir=f"{tmp}/handoff",
                log_level="warning",
            )
        else:
            view = make_view(0, args.tensors, args.numel)
            engine = FakeEngine(token_delay_s=0.0)
            engine_server = AppServer(engine.app())
            settings = SidecarSettings(
                bulletin=url, run=RUN, engine_url=engine_server.url, handoff_dir=f"{tmp}/handoff", log_level="warning"
            )
            engine.url = engine_server.url
        anchor = publisher.publish(view)
        if args.engine_url:
            _boot_at_version_0(engine, args.checkpoint, anchor)
        sidecar = AppServer(create_app(settings, engine=engine, client=BulletinClient(url)))
        gate = lambda: sidecar.server.config.app.state.gate
        try:
            while gate().applied != 0:
                time.sleep(0.01)
            applied, served, published, sizes, syncs = [], [], [], [], []
            http = httpx.Client(base_url=sidecar.url, timeout=60)
            model = http.get("/v1/models").json()["data"][0]["id"]
            for step in range(1, args.steps + 1):
                view = mutate(view, seed=step, fraction=args.fraction)
                holder: dict[str, float] = {}

                def held(v: int = step, out: dict = holder) -> None:
                    r = http.post(
                        "/v1/completions",
                        json={"model": model, "prompt": "x", "max_tokens": 1},
                        headers={"X-Stitch-Min-Version": str(v), "X-Stitch-Wait-S": "60"},
                    )
                    out["at"] = time.perf_counter()
                    out["end"] = r.json()["weight_version_end"]

                waiter = threading.Thread(target=held)
                waiter.start()
                time.sleep(0.02)  # the request is held at the gate
                manifest = publisher.prepare(view)  # diff and upload, untimed
                start = time.perf_counter()
                publisher.commit(manifest, view)
                published.append(time.perf_counter() - start)
                while gate().applied != step:
                    time.sleep(0.001)
                applied.append(time.perf_counter() - start)
                waiter.join()
                served.append(holder["at"] - start)
                assert holder["end"] == step
                sizes.append(manifest.stats.encoded_bytes)
                syncs.append(sidecar.server.config.app.state.reconciler.last_sync)
            http.close()
        finally:
            sidecar.stop()
            if engine_server is not None:
                engine_server.stop()
            client.close()
            bulletin.terminate()
            bulletin.wait(10)

    ms = lambda xs: ", ".join(f"{1000 * x:.1f}" for x in (statistics.median(xs), _pct(xs, 0.9), max(xs)))
    view_mb = sum(t.nbytes for t in view.values()) / 1e6
    kind = f"vLLM at {args.engine_url}" if args.engine_url else "fake engine"
    print(
        f"sidecar publish -> applied over loopback, {kind}, {args.steps} steps, view {view_mb:.1f} MB, "
        f"{args.fraction:.1%} changed per step"
    )
    print(f"  patch size per step: median {statistics.median(sizes) / 1024:.1f} KiB")
    print(f"  publish call (manifest commit; files uploaded before) (ms p50, p90, max): {ms(published)}")
    print(f"  publish -> applied  (ms p50, p90, max): {ms(applied)}   target p50 <= 1000 ms")
    print(f"  publish -> a held request answered (ms p50, p90, max): {ms(served)}")
    print(
        f"  per sync (ms p50): fetch {1000 * statistics.median(s.stage_seconds for s in syncs):.1f}, "
        f"engine staging while serving {1000 * statistics.median(s.engine_stage_seconds for s in syncs):.1f}, "
        f"pause {1000 * statistics.median(s.pause_seconds for s in syncs):.1f}, "
        f"apply {1000 * statistics.median(s.apply_seconds for s in syncs):.1f}, "
        f"seen -> applied {1000 * statistics.median(s.total_seconds for s in syncs):.1f}"
    )


if __name__ == "__main__":
    main()
