"""Benchmark: prefix-cache hit rate and commit pause with the cache reset at every commit vs salted by version (prints
figures).

One real engine (``--engine vllm``: vLLM on the CPU with the stitchboard worker extension;
``--engine sglang``: SGLang on the CPU, TP = 1, stitchboard's loader) serves SmolLM2-135M behind
a ``stitchboard sidecar run`` process; a bulletin on loopback and the trainer SDK publish real
AdamW steps (:class:`tests.sidecar.vllm_fixtures.VllmRun`). For each mode (``reset``: the
default; ``salt``: ``--salt-cache``) the same engine is followed through ``--versions``
commits; at each version ``--requests`` greedy completions share a long prefix (``--prefix``
sentences) with a short distinct suffix, sent one after another, and the commit comes while
nothing is in flight (the synchronous RL pattern, the case where salting skips the reset).

Figures: the prefix-cache hit rate over each mode's requests (prompt tokens served from the
cache / prompt tokens: vLLM's ``vllm:prefix_cache_hits`` / ``queries``; SGLang's
``meta_info.cached_tokens`` / ``prompt_tokens`` of each ``/generate`` answer), and the sidecar's
pause per commit (``last_sync.pause_seconds``).

Run: ``python -m tests.benchmarks.bench_salt [--engine vllm|sglang] [--versions 4] [--requests 6] [--prefix 20]``.
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
from tests.sidecar.sglang_helpers import SglangServer
from tests.sidecar.vllm_fixtures import SidecarProcess, VllmRun
from tests.support.vllm_server import VllmServer


def _counter(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
    )


def _workload(
    engine: str, sidecar_url: str, model: str, prefix: str, requests: int, version: int
) -> tuple[float, float]:
    # The requests of one version; returns (cached, prompt) tokens where the answers report them (SGLang).
    cached = prompt = 0.0
    for i in range(requests):
        text = f"{prefix} Question {version}-{i}: how many boats?"
        if engine == "sglang":
            r = httpx.post(
                f"{sidecar_url}/generate",
                json={"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                timeout=600,
            )
            r.raise_for_status()
            cached, prompt = (
                cached + r.json()["meta_info"]["cached_tokens"],
                prompt + r.json()["meta_info"]["prompt_tokens"],
            )
        else:
            r = httpx.post(
                f"{sidecar_url}/v1/completions",
                json={"model": model, "prompt": text, "max_tokens": 8, "temperature": 0},
                timeout=600,
            )
            r.raise_for_status()
    time.sleep(0.5)  # vLLM's counters are updated just after its last answer
    return cached, prompt


def _hits(engine: str, url: str) -> tuple[float, float]:
    # vLLM's prefix-cache counters (hit, queried tokens) now; SGLang's answers report theirs instead.
    return (
        (_counter(url, "prefix_cache_hits"), _counter(url, "prefix_cache_queries")) if engine == "vllm" else (0.0, 0.0)
    )


def run_mode(
    mode: str, run: VllmRun, engine: VllmServer | SglangServer, folder: Path, args: argparse.Namespace
) -> dict[str, float]:
    """Follow ``args.versions`` commits with the sidecar in ``mode``; returns hit rate and pause figures."""
    (folder / mode).mkdir()
    env = {
        "STITCH_SIDECAR_SALT_CACHE": str(mode == "salt").lower(),
        "STITCH_SIDECAR_REPORT": "false",
        "STITCH_SIDECAR_ENGINE": args.engine,
    }
    if args.engine == "sglang":
        env["STITCH_SIDECAR_BOOT_VERSION"] = "0"  # the server was started from version 0's checkpoint
    sidecar = SidecarProcess(run, engine.url, folder / mode, env)
    prefix = " ".join(
        f"Item {i}: the harbour master counted {i * 7 % 13} boats and {i * 5 % 11} nets." for i in range(args.prefix)
    )
    pauses: list[float] = []
    try:
        sidecar.wait_applied(run.latest, timeout_s=600)
        before = _hits(args.engine, engine.url)
        hits = queries = 0.0  # as the answers report them (SGLang)
        for _ in range(args.versions):
            v = run.step()
            pauses.append(sidecar.wait_applied(v, timeout_s=600)["last_sync"]["pause_seconds"])
            cached, prompt = _workload(args.engine, sidecar.url, engine.model, prefix, args.requests, v)
            hits, queries = hits + cached, queries + prompt
        after = _hits(args.engine, engine.url)  # as the engine's counters say (vLLM)
        hits, queries = hits + after[0] - before[0], queries + after[1] - before[1]
    finally:
        sidecar.stop()
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "hits": hits,
        "queries": queries,
        "pause_p50_s": statistics.median(pauses),
        "pause_mean_s": statistics.fmean(pauses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="the engine behind the sidecar")
    parser.add_argument("--versions", type=int, default=4, help="commits per mode")
    parser.add_argument("--requests", type=int, default=6, help="requests per version")
    parser.add_argument("--prefix", type=int, default=20, help="sentences of the shared prefix (~20 tokens each)")
    args = parser.parse_args()
    model_dir = build_smollm2_checkpoint()
    with tempfile.TemporaryDirectory(
        prefix="bench-salt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    ) as tmp:
        folder = Path(tmp)
        engine: VllmServer | SglangServer = (
            SglangServer(model_dir, folder / "engine.log")
            if args.engine == "sglang"
            else VllmServer(model_dir, folder / "engine.log")
        )
        run = None
        try:
            engine.wait_ready()
            run = VllmRun(model_dir, folder / "run")
            results = {mode: run_mode(mode, run, engine, folder, args) for mode in ("reset", "salt")}
        finally:
            if run is not None:
                run.close()
            engine.stop()
    print(
        f"{args.engine}: {args.versions} commits per mode, {args.requests} requests per version sharing a "
        f"{args.prefix}-sentence prefix, commits while idle"
    )
    print(f"{'mode':6} {'hit rate':>9} {'hit tokens':>11} {'queried':>8} {'pause p50':>10} {'pause mean':>11}")
    for mode, r in results.items():
        print(
            f"{mode:6} {r['hit_rate']:9.3f} {r['hits']:11.0f} {r['queries']:8.0f} {r['pause_p50_s'] * 1e3:8.1f}ms "
            f"{r['pause_mean_s'] * 1e3:9.1f}ms"
        )
    reset, salt = results["reset"], results["salt"]
    print(
        f"salt/reset: hit rate {salt['hit_rate'] / reset['hit_rate'] if reset['hit_rate'] else float('nan'):.3f}, "
        f"pause p50 {salt['pause_p50_s'] / reset['pause_p50_s']:.3f}"
    )


if __name__ == "__main__":
    main()
