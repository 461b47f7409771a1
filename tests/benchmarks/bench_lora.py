"""LoRA adapter versions on SmolLM2: bytes per version, change density, load -> servable, base tokens/s during swaps,
memory per resident adapter.

Run: ``python -m tests.benchmarks.bench_lora [--steps 6]`` (needs vLLM and PEFT in the running interpreter;
exits 0 with a note when either is absent). One run:

1. the demo's LoRA policy (:mod:`stitchboard.demo.lora_policy`: r 8, alpha 16, q/k/v/o of SmolLM2-135M,
   float32 masters) takes ``--steps`` real AdamW steps (lr 1e-4) of next-token loss on a fixed batch
   (4 x 64 tokens of :data:`tests.support.training.TRAINING_TEXT`); version N is the adapter's bf16
   served view after step N (version 0: PEFT's initial adapter, B = 0). Per version: the adapter's
   bytes, the elements whose bf16 bits changed, and the ``cond`` patch from N-1 (the publisher's
   default encoding, :func:`stitchboard.proto.diff.diff_views`);
2. one vLLM server (CPU build, ``--enable-lora``, 3 adapter slots, ``max_cpu_loras`` 3), runtime
   adapter updates on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
3. memory per resident adapter: the engine's RSS (the server and its engine-core process) before any
   adapter and after each of the first three versions is loaded (``/v1/load_lora_adapter`` from a PEFT
   folder on ``/dev/shm``) and answered once;
4. base tokens/s during swaps vs before: one client streams greedy base-model completions
   (128 tokens each, ``ignore_eos``) the whole time; tokens/s over ``--window-s`` seconds with nothing
   else, then over the same length while every second a new adapter version is loaded and the
   oldest unloaded (the sidecar's swap: load before unload), and the longest gap between two tokens
   in each window;
5. load -> servable per version: from the start of its ``cond`` encode (what the trainer does at
   publish) through writing the PEFT folder, the engine's load, to the first answer (1 token) naming
   it. This path has no bulletin and no sidecar (say so where the figure is quoted).

Last line::

    lora: versions=<n> patch_bytes_median=<n> servable_p50_s=<x> swap_tokens_ratio=<x>
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.support.vllm_server import vllm_importable

#: Adapter slots of the benchmark's engine (``--max-loras``; also ``--max-cpu-loras``).
SLOTS = 3


def _train(steps: int) -> tuple[list[dict], list[dict], dict]:
    """``steps`` AdamW steps of the LoRA policy: each version's bf16 tensors, its figures, the adapter config."""
    from stitchboard.demo.lora_policy import adapter_tensors, lora_optimizer, lora_policy
    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.proto.diff import diff_views
    from stitchboard.trainer_client.served_view import to_raw
    from tests.support.training import TRAINING_TEXT

    model_dir = build_smollm2_checkpoint()
    policy = lora_policy(model_dir)
    optimizer = lora_optimizer(policy)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TRAINING_TEXT, return_tensors="pt")["input_ids"][0]
    batch = ids[: 4 * 64].reshape(4, 64)
    views = [adapter_tensors(policy)]
    rows: list[dict] = []
    for step in range(1, steps + 1):
        policy.train()
        loss = policy(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        views.append(adapter_tensors(policy))
        base = {k: to_raw(v) for k, v in views[-2].items()}
        target = {k: to_raw(v) for k, v in views[-1].items()}
        t0 = time.perf_counter()
        diff = diff_views(base, target, "cond")
        encode_s = time.perf_counter() - t0
        adapter_bytes = sum(t.nbytes for t in target.values())
        rows.append(
            {
                "version": step,
                "loss": round(float(loss.detach()), 4),
                "adapter_bytes": adapter_bytes,
                "patch_bytes": len(diff.patch),
                "patch_over_adapter": round(len(diff.patch) / adapter_bytes, 4),
                "changed_pct": round(100 * diff.changed_elements / diff.total_elements, 2),
                "encode_s": round(encode_s, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    config = policy.peft_config["default"].to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v)) for k, v in config.items()}
    config["base_model_name_or_path"] = str(model_dir)
    return views, rows, {"model_dir": model_dir, "config": config}


def _write_folder(root: Path, name: str, tensors: dict, config: dict) -> Path:
    """A PEFT folder (``adapter_model.safetensors`` + ``adapter_config.json``) under ``root``."""
    from safetensors.torch import save_file

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _engine_rss(pid: int) -> int:
    """RSS of the server process and its descendants (vLLM's engine core), bytes."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


class BaseStream:
    """Streams greedy base-model completions back to back in a thread; keeps every token's arrival time."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.times = url, model, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 128, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                with http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            self.times.append(time.perf_counter())
                        if self._stop.is_set():
                            break

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """(tokens/s, longest gap between two tokens in seconds) over ``[t0, t1]``."""
        inside = [t for t in self.times if t0 <= t <= t1]
        gaps = [b - a for a, b in itertools.pairwise(inside)]
        return len(inside) / (t1 - t0), max(gaps, default=float("nan"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _load(http: httpx.Client, name: str, folder: Path) -> None:
    resp = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
    resp.raise_for_status()


def _unload(http: httpx.Client, name: str) -> None:
    http.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()


def _answer(http: httpx.Client, name: str) -> None:
    body = {"model": name, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    http.post("/v1/completions", json=body).raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="LoRA training steps (versions after version 0)")
    parser.add_argument("--window-s", type=float, default=20.0, help="seconds of each base-stream window")
    args = parser.parse_args()
    if not vllm_importable() or importlib.util.find_spec("peft") is None:
        print("bench_lora: vLLM or PEFT is not importable here; run it with .venv/bin/python after `make venv`")
        return 0
    from stitchboard.demo.lora_policy import LORA_RANK
    from stitchboard.demo.processes import ManagedProcess, free_port
    from stitchboard.proto.diff import diff_views
    from stitchboard.sidecar.engines.vllm.launch import vllm_command, vllm_env
    from stitchboard.trainer_client.served_view import to_raw
    from tests.support.shm import remove_orphaned_shm

    views, rows, info = _train(args.steps)
    shm = Path(tempfile.mkdtemp(prefix="bench-lora-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    logs = Path(tempfile.mkdtemp(prefix="bench-lora-logs-"))
    port = free_port()
    argv = vllm_command(
        info["model_dir"], port, served_model_name="base", extension=False, max_loras=SLOTS, max_lora_rank=LORA_RANK
    )
    env = vllm_env(lora=True)
    engine = ManagedProcess("vllm-lora", argv, logs / "vllm.log", f"http://127.0.0.1:{port}/health", env=env)
    try:
        start_s = engine.wait_healthy(900)
        url = f"http://127.0.0.1:{port}"
        print(f"engine with LoRA ready in {start_s:.0f} s", flush=True)
        http = httpx.Client(base_url=url, timeout=120)
        _answer(http, "base")  # warm
        time.sleep(2)
        rss = [_engine_rss(engine.proc.pid)]
        for v in range(SLOTS):
            _load(http, f"mem@{v}", _write_folder(shm, f"mem{v}", views[v], info["config"]))
            _answer(http, f"mem@{v}")
            time.sleep(1)
            rss.append(_engine_rss(engine.proc.pid))
        for v in range(SLOTS):
            _unload(http, f"mem@{v}")
        per_adapter = [(b - a) / 2**20 for a, b in itertools.pairwise(rss)]
        print(f"engine RSS {rss[0] / 2**20:.0f} MiB before adapters; + per adapter loaded: "
              f"{', '.join(f'{d:.1f}' for d in per_adapter)} MiB", flush=True)  # fmt: skip

        stream = BaseStream(url, "base")
        time.sleep(3)  # the stream under way
        t0 = time.perf_counter()
        time.sleep(args.window_s)
        t1 = time.perf_counter()
        resident: list[str] = []
        swaps = 0
        while time.perf_counter() - t1 < args.window_s:
            v = 1 + swaps % args.steps
            name = f"swap{swaps}@{v}"
            _load(http, name, _write_folder(shm, f"swap{swaps}", views[v], info["config"]))
            resident.append(name)
            if len(resident) > SLOTS - 1:
                _unload(http, resident.pop(0))
            swaps += 1
            time.sleep(max(0.0, t1 + swaps - time.perf_counter()))
        t2 = time.perf_counter()
        stream.stop()
        before_tps, before_gap = stream.window(t0, t1)
        during_tps, during_gap = stream.window(t1, t2)
        ratio = during_tps / before_tps
        print(f"base stream: {before_tps:.2f} tokens/s before (longest gap {before_gap * 1000:.0f} ms), "
              f"{during_tps:.2f} tokens/s during {swaps} swaps (longest gap {during_gap * 1000:.0f} ms): "
              f"ratio {ratio:.3f}", flush=True)  # fmt: skip
        for name in resident:
            _unload(http, name)

        servable = []
        for v in range(1, args.steps + 1):
            t_pub = time.perf_counter()
            diff_views({k: to_raw(t) for k, t in views[v - 1].items()}, {k: to_raw(t) for k, t in views[v].items()},
                       "cond")  # fmt: skip
            folder = _write_folder(shm, f"ver{v}", views[v], info["config"])
            _load(http, f"run@{v}", folder)
            _answer(http, f"run@{v}")
            servable.append(time.perf_counter() - t_pub)
            if v > SLOTS - 1:
                _unload(http, f"run@{v - SLOTS + 1}")
            shutil.rmtree(folder)
        print(f"encode -> folder -> engine load -> first answer, per version (s): "
              f"{', '.join(f'{s:.3f}' for s in servable)}", flush=True)  # fmt: skip
        http.close()
    finally:
        engine.stop()
        remove_orphaned_shm()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    patch_median = int(statistics.median(r["patch_bytes"] for r in rows))
    print(f"adapter {rows[0]['adapter_bytes']} bytes; changed % per version "
          f"{[r['changed_pct'] for r in rows]}; patch/adapter {[r['patch_over_adapter'] for r in rows]}")  # fmt: skip
    print(
        f"lora: versions={len(rows)} patch_bytes_median={patch_median} "
        f"servable_p50_s={statistics.median(servable):.3f} swap_tokens_ratio={ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
