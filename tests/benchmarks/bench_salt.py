"""Benchmark: prefix-cache hit rate and commit pause with the cache reset at every commit vs salted by version (prints figures).

One real vLLM (CPU, the stitchboard worker extension) serves SmolLM2-135M behind a ``stitchboard
sidecar run`` process; a bulletin on loopback and the trainer SDK publish real AdamW steps
(:class:`tests.sidecar.vllm_fixtures.VllmRun`). For each mode (``reset``: the default;
``salt``: ``--salt-cache``) the same sidecar-less engine is followed through ``--versions``
commits; at each version ``--requests`` greedy completions share a long prefix (``--prefix``
sentences) with a short distinct suffix, sent one after another, and the commit comes while
nothing is in flight (the synchronous RL pattern, the case where salting skips the reset).

Figures: the engine's prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``queries``, tokens)
over each mode's requests, and the sidecar's pause per commit (``last_sync.pause_seconds``).

Run: ``python -m tests.benchmarks.bench_salt [--versions 4] [--requests 6] [--prefix 20]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from tests.sidecar.vllm_fixtures import SidecarProcess, VllmRun
from tests.support.vllm_server import VllmServer


def _counter(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


def _workload(sidecar_url: str, model: str, prefix: str, requests: int, version: int) -> None:
    for i in range(requests):
        body = {"model": model, "prompt": f"{prefix} Question {version}-{i}: how many boats?", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{sidecar_url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
    time.sleep(0.5)  # the engine's counters are updated just after its last answer


def run_mode(mode: str, run: VllmRun, engine: VllmServer, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Follow ``args.versions`` commits with the sidecar in ``mode``; returns hit rate and pause figures."""
    (folder / mode).mkdir()
    sidecar = SidecarProcess(run, engine.url, folder / mode, {"STITCH_SIDECAR_SALT_CACHE": str(mode == "salt").lower(), "STITCH_SIDECAR_REPORT": "false"})
    prefix = " ".join(f"Item {i}: the harbour master counted {i * 7 % 13} boats and {i * 5 % 11} nets." for i in range(args.prefix))
    pauses: list[float] = []
    try:
        sidecar.wait_applied(run.latest, timeout_s=600)
        hits, queries = _counter(engine.url, "prefix_cache_hits"), _counter(engine.url, "prefix_cache_queries")
        for _ in range(args.versions):
            v = run.step()
            pauses.append(sidecar.wait_applied(v, timeout_s=600)["last_sync"]["pause_seconds"])
            _workload(sidecar.url, engine.model, prefix, args.requests, v)
        hits, queries = _counter(engine.url, "prefix_cache_hits") - hits, _counter(engine.url, "prefix_cache_queries") - queries
    finally:
        sidecar.stop()
    return {"hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries, "pause_p50_s": statistics.median(pauses), "pause_mean_s": statistics.fmean(pauses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=4, help="commits per mode")
    parser.add_argument("--requests", type=int, default=6, help="requests per version")
    parser.add_argument("--prefix", type=int, default=20, help="sentences of the shared prefix (~20 tokens each)")
    args = parser.parse_args()
    model_dir = build_smollm2_checkpoint()
    with tempfile.TemporaryDirectory(prefix="bench-salt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        folder = Path(tmp)
        engine = VllmServer(model_dir, folder / "engine.log")
        run = None
        try:
            engine.wait_ready()
            run = VllmRun(model_dir, folder / "run")
            results = {mode: run_mode(mode, run, engine, folder, args) for mode in ("reset", "salt")}
        finally:
            if run is not None:
                run.close()
            engine.stop()
    print(f"{args.versions} commits per mode, {args.requests} requests per version sharing a {args.prefix}-sentence prefix, commits while idle")
    print(f"{'mode':6} {'hit rate':>9} {'hit tokens':>11} {'queried':>8} {'pause p50':>10} {'pause mean':>11}")
    for mode, r in results.items():
        print(f"{mode:6} {r['hit_rate']:9.3f} {r['hits']:11.0f} {r['queries']:8.0f} {r['pause_p50_s'] * 1e3:8.1f}ms {r['pause_mean_s'] * 1e3:9.1f}ms")
    reset, salt = results["reset"], results["salt"]
    print(f"salt/reset: hit rate {salt['hit_rate'] / reset['hit_rate'] if reset['hit_rate'] else float('nan'):.3f}, pause p50 {salt['pause_p50_s'] / reset['pause_p50_s']:.3f}")


if __name__ == "__main__":
    main()
