"""vLLM on the CPU: publish -> applied over real steps, idle and while N greedy streams generate.

Run: ``python -m tests.benchmarks.bench_vllm_sync [--streams 50] [--publishes 20] [--part-bytes N]`` (needs vLLM in
the running interpreter; exits 0 with a note when it is absent). One run, on one vLLM server
(CPU build, TP = 1, the stitchboard worker extension, started as the tests start it) with
SmolLM2-135M and a ``stitchboard sidecar run`` subprocess in front of it:

1. **idle**: ``--publishes`` real AdamW steps (:class:`tests.support.training.CpuTrainer`, batch
   1 x 32 tokens) published by the trainer SDK to a bulletin on loopback; each timed from the
   start of ``Publisher.publish`` (encode, upload, commit) to the end of the sidecar's sync that
   applied the version (its ``last_sync.finished_at``, read from its status), and from the commit
   (the call's return).
2. **streams**: the same with ``--streams`` concurrent greedy completions of ``--tokens`` tokens
   each (``ignore_eos``, distinct prompts) sent through the sidecar and re-issued as each
   finishes; the step itself is trained while they run (unmeasured). Before each publish one
   state call (the adapter's ``state()``: ``collective_rpc stitch_state`` and ``/is_paused``) is
   timed from here, as the sidecar's engine check makes it.

For both it prints p50/p95/max and the sidecar's per-sync breakdown (fetch, staging in the engine
while it serves, pause, apply, seen -> applied), the tokens the engine generated meanwhile
(``vllm:generation_tokens_total``), and last::

    vllm_sync: idle_p50_s=<x> idle_p95_s=<x> streams50_p50_s=<x> bytes_per_step=<n>

(``streams<N>`` for ``--streams N``; seconds from the start of the publish call; bytes: the
median encoded patch size of a step). Target (issue 27 E): streams p50 under 5 s with 50 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.support.vllm_server import VllmServer, vllm_importable

#: Breakdown of a sync in the sidecar's ``last_sync`` (seconds).
SYNC_KEYS = ("stage_seconds", "engine_stage_seconds", "pause_seconds", "apply_seconds", "total_seconds")


def _p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile (of 20 values: the 19th smallest)."""
    return sorted(values)[max(0, math.ceil(0.95 * len(values)) - 1)]


class Streams:
    """``count`` concurrent greedy completions of ``tokens`` tokens through ``url``, each re-issued
    as it finishes, on an event loop in a thread of its own, until :meth:`stop`.

    Attributes:
        tokens_done: completion tokens of the requests finished so far.
        errors: requests that failed (status or transport), with the last error's text in ``last_error``.
    """

    def __init__(self, url: str, model: str, count: int, tokens: int) -> None:
        self.url, self.model, self.count, self.tokens = url, model, count, tokens
        self.tokens_done = 0
        self.errors = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="bench-streams", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop re-issuing and cut the requests in flight (waits at most 30 s)."""
        self._stop.set()
        self._thread.join(30)

    async def _one(self, client: httpx.AsyncClient, index: int) -> None:
        round_ = 0
        while not self._stop.is_set():
            body = {
                "model": self.model,
                "prompt": f"Story {index}.{round_}: a long walk along the coast began when",
                "max_tokens": self.tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            round_ += 1
            try:
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code == 200:
                    self.tokens_done += int(resp.json()["usage"]["completion_tokens"])
                    continue
                self.errors, self.last_error = self.errors + 1, f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                self.errors, self.last_error = self.errors + 1, f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(1.0)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.count + 4, max_keepalive_connections=self.count + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=900, limits=limits) as client:
            tasks = [asyncio.create_task(self._one(client, i)) for i in range(self.count)]
            while not self._stop.is_set():
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _generated_tokens(engine_url: str) -> float:
    """Tokens the engine has generated so far (vLLM's ``vllm:generation_tokens_total`` counter)."""
    text = httpx.get(f"{engine_url}/metrics", timeout=60).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


def _publishes(run, sidecar, count: int, probe=None) -> dict[str, list]:
    """``count`` real steps, each trained then published and waited for until applied."""
    out: dict[str, list] = {"from_start": [], "from_commit": [], "bytes": [], "syncs": [], "probe": []}
    for _ in range(count):
        run.train()
        if probe is not None:
            out["probe"].append(probe())
        w0, t0 = time.time(), time.perf_counter()
        v = run.publish()
        t1 = time.perf_counter()
        status = sidecar.wait_status(lambda s, v=v: s["applied_version"] == v, f"version {v} applied", 900)
        sync = status["last_sync"]
        if sync["to_version"] != v:
            raise AssertionError(f"the sidecar's last sync is to version {sync['to_version']}, not {v}")
        # Applied when the sidecar's sync finished (its Unix time; this host's clock), not when a status poll
        # (every 0.1 s) saw it.
        t2 = t0 + (sync["finished_at"] - w0)
        out["from_start"].append(t2 - t0)
        out["from_commit"].append(t2 - t1)
        out["bytes"].append(run.client.manifest(run.run, v).stats.encoded_bytes)
        out["syncs"].append(status["last_sync"])
        print(
            f"  v{v}: publish -> applied {t2 - t0:.3f} s (from the commit {t2 - t1:.3f}); sidecar: "
            + ", ".join(f"{k.removesuffix('_seconds')} {status['last_sync'][k]:.3f}" for k in SYNC_KEYS)
            + (f"; state call before it {out['probe'][-1]:.3f} s" if probe is not None else ""),
            flush=True,
        )
    return out


def _summary(label: str, result: dict[str, list]) -> str:
    xs, cs = result["from_start"], result["from_commit"]
    parts = ", ".join(
        f"{k.removesuffix('_seconds')} {statistics.median(s[k] for s in result['syncs']):.3f}" for k in SYNC_KEYS
    )
    probe = (
        f"; state call p50 {statistics.median(result['probe']):.3f} s max {max(result['probe']):.3f}"
        if result["probe"]
        else ""
    )
    return (
        f"{label}: publish -> applied p50 {statistics.median(xs):.3f} s, p95 {_p95(xs):.3f}, max {max(xs):.3f} "
        f"(from the commit p50 {statistics.median(cs):.3f}); sidecar medians: {parts}{probe}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=50, help="concurrent greedy streams in the second phase")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each stream generates before it is re-issued")
    parser.add_argument("--publishes", type=int, default=20, help="publishes timed in each phase")
    parser.add_argument(
        "--part-bytes",
        type=int,
        default=None,
        help="the publisher's row-part size, bytes (0: one stream per tensor, the format before issue 32; "
        "default: the publisher's default, trainer_client.link.PART_BYTES)",
    )
    parser.add_argument(
        "--logs", type=Path, help="a folder to copy the engine's and the sidecar's logs into at the end"
    )
    args = parser.parse_args()
    if not vllm_importable():
        print("bench_vllm_sync: vLLM is not importable in this interpreter; run it with .venv/bin/python")
        return 0
    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from stitchboard.sidecar.engines.vllm.launch import vllm_env
    from tests.sidecar.vllm_fixtures import SidecarProcess, VllmRun

    model_dir = build_smollm2_checkpoint()
    folder = Path(tempfile.mkdtemp(prefix="bench-vllm-sync-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    engine = VllmServer(model_dir, folder / "engine.log")
    run = sidecar = streams = None
    last = ""
    try:
        t = time.perf_counter()
        engine.wait_ready()
        print(f"vLLM ready in {time.perf_counter() - t:.1f} s (engine environment {vllm_env()})", flush=True)
        options = {} if args.part_bytes is None else {"part_bytes": args.part_bytes or None}
        run = VllmRun(model_dir, folder / "run", **options)
        sidecar = SidecarProcess(run, engine.url, folder, {"STITCH_SIDECAR_BOOT_VERSION": "0"})
        sidecar.wait_applied(0, 600)
        print(f"idle: {args.publishes} publishes", flush=True)
        idle = _publishes(run, sidecar, args.publishes)
        print(_summary("idle", idle), flush=True)

        print(f"{args.streams} streams of {args.tokens} tokens: {args.publishes} publishes", flush=True)
        adapter = VllmEngine(engine.url, timeout_s=900)

        def probe() -> float:
            t = time.perf_counter()
            adapter.state()
            return time.perf_counter() - t

        streams = Streams(sidecar.url, engine.model, args.streams, args.tokens)
        streams.start()
        time.sleep(10.0)  # every stream admitted and generating
        t = time.perf_counter()
        tokens_before, generated_before = streams.tokens_done, _generated_tokens(engine.url)
        loaded = _publishes(run, sidecar, args.publishes, probe)
        seconds = time.perf_counter() - t
        rate = (streams.tokens_done - tokens_before) / seconds
        generated = (_generated_tokens(engine.url) - generated_before) / seconds
        streams.stop()
        adapter.close()
        print(_summary(f"{args.streams} streams", loaded), flush=True)
        print(
            f"streams while publishing: the engine generated {generated:.1f} tokens/s, requests that finished "
            f"{rate:.1f} tokens/s; {streams.errors} failed requests {streams.last_error}"
        )
        last = (
            f"vllm_sync: idle_p50_s={statistics.median(idle['from_start']):.3f} "
            f"idle_p95_s={_p95(idle['from_start']):.3f} "
            f"streams{args.streams}_p50_s={statistics.median(loaded['from_start']):.3f} "
            f"bytes_per_step={int(statistics.median(idle['bytes'] + loaded['bytes']))}"
        )
    finally:
        if streams is not None:
            streams.stop()
        if sidecar is not None:
            sidecar.stop()
        if run is not None:
            run.close()
        engine.stop()
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in folder.glob("*.log"):
                shutil.copy(log, args.logs / log.name)
        shutil.rmtree(folder, ignore_errors=True)  # /dev/shm is memory
    print(last, flush=True)  # after the clean-up, whose servers may log as they stop
    return 0


if __name__ == "__main__":
    sys.exit(main())
