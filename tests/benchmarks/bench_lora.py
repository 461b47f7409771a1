"""LoRA adapter versions through the whole stack: bytes per version, change density, publish -> servable, base-model
tokens/s during swaps, memory per resident adapter.

Run: ``python -m tests.benchmarks.bench_lora [--steps 6]`` (needs vLLM and PEFT in the running interpreter;
exits 0 with a note when either is absent). One run:

1. the demo's LoRA policy (:mod:`stitchboard.demo.lora_policy`: r 8, alpha 16, q/k/v/o of SmolLM2-135M,
   float32 masters) takes ``--steps`` real AdamW steps (lr 1e-4) of next-token loss on a fixed batch
   (4 x 64 tokens of :data:`tests.support.training.TRAINING_TEXT`); version N is the adapter after step N
   (version 0: PEFT's initial adapter, B = 0). Per version: the adapter's bf16 bytes, the elements whose
   bf16 bits changed and the ``cond`` patch from N-1 (:func:`stitchboard.proto.diff.diff_views`, the
   publisher's default encoding);
2. the stack of ``stitchboard demo --lora`` (:mod:`stitchboard.demo.lora_engine`): a bulletin on a local
   folder, one vLLM (CPU build, LoRA on, 3 adapter slots, the worker extension) behind a sidecar keeping 2
   versions resident, its hand-off folder on ``/dev/shm``. Each version is published with the SDK's
   ``Publisher.publish`` of the PeftModel (its float32 adapter state set back with PEFT's
   ``set_peft_model_state_dict``), in order;
3. memory per resident adapter: the engine's RSS (the server and its engine-core process) before any
   version, and after versions 0 and 1 are resident: (RSS with two resident - RSS before) / 2;
4. publish -> servable per version: from the call to ``publish`` until the sidecar's ``/v1/models`` lists
   ``<run>@<N>`` (polled every 50 ms): fetched, rebuilt, written, loaded by vLLM and verified;
5. base tokens/s during swaps vs before: one client streams greedy base-model completions through the
   sidecar (128 tokens each, ``ignore_eos``) the whole time; tokens/s over ``--window-s`` seconds with
   nothing else, then over the time versions 2..N are published (one every ``--every-s``) and swapped in
   (the sidecar loads the new one before unloading the oldest), and the longest gap between two tokens in
   each window.

Last line::

    lora: versions=<n> patch_bytes_median=<n> servable_p50_s=<x> swap_tokens_ratio=<x>

``patch_bytes_median`` is over the versions 1..N the SDK published (its ``encoded_bytes``).
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

#: The adapter run the benchmark publishes.
RUN = "bench-lora"


def _train(steps: int) -> tuple[object, list[dict], list[dict], Path]:
    """``steps`` AdamW steps of the LoRA policy: the policy, each version's float32 adapter state (PEFT's names),
    each step's figures, the base checkpoint folder."""
    from peft import get_peft_model_state_dict
    from transformers import AutoTokenizer

    from stitchboard.demo.lora_policy import adapter_tensors, lora_optimizer, lora_policy
    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.proto.diff import diff_views
    from stitchboard.trainer_client.served_view import to_raw
    from tests.support.training import TRAINING_TEXT

    model_dir = build_smollm2_checkpoint()
    policy = lora_policy(model_dir)
    optimizer = lora_optimizer(policy)
    ids = AutoTokenizer.from_pretrained(model_dir)(TRAINING_TEXT, return_tensors="pt")["input_ids"][0]
    batch = ids[: 4 * 64].reshape(4, 64)

    def state() -> dict:
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()}

    states, views, rows = [state()], [adapter_tensors(policy)], []
    for step in range(1, steps + 1):
        policy.train()
        loss = policy(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        states.append(state())
        views.append(adapter_tensors(policy))
        base = {k: to_raw(v) for k, v in views[-2].items()}
        target = {k: to_raw(v) for k, v in views[-1].items()}
        diff = diff_views(base, target, "cond")
        adapter_bytes = sum(t.nbytes for t in target.values())
        rows.append(
            {
                "version": step,
                "loss": round(float(loss.detach()), 4),
                "adapter_bytes": adapter_bytes,
                "cond_patch_bytes": len(diff.patch),
                "patch_over_adapter": round(len(diff.patch) / adapter_bytes, 4),
                "changed_pct": round(100 * diff.changed_elements / diff.total_elements, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return policy, states, rows, model_dir


def _engine_rss(pid: int) -> int:
    """RSS of the server process and its descendants (vLLM's engine core), bytes."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


class BaseStream:
    """Streams greedy base-model completions back to back in a thread; keeps every token's arrival time."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.times, self.errors = url, model, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 128, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                with http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        self.errors.append(f"{resp.status_code} {resp.read()[:200]!r}")
                        time.sleep(0.5)
                        continue
                    for line in resp.iter_lines():
                        if line.startswith("data: {") and '"text":""' not in line:
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


def _published(publisher, policy, state: dict, version: int) -> dict:
    """Set ``state`` into ``policy`` and publish it as ``version`` (its step); the SDK's figures."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(policy, state)
    res = publisher.publish(policy, step=version)
    if res.version != version:
        raise RuntimeError(f"published version {res.version}, expected {version}")
    return {"version": version, "encoded_bytes": res.encoded_bytes, "snapshot_bytes": res.snapshot_bytes,
            "changed_pct": round(100 * res.changed_elements / res.total_elements, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="LoRA training steps (versions after version 0)")
    parser.add_argument("--window-s", type=float, default=20.0, help="seconds of the base stream before the swaps")
    parser.add_argument("--every-s", type=float, default=3.0, help="seconds between two publishes during the swaps")
    args = parser.parse_args()
    if not vllm_importable() or importlib.util.find_spec("peft") is None:
        print("bench_lora: vLLM or PEFT is not importable here; run it with .venv/bin/python after `make venv`")
        return 0
    from stitchboard.demo.engines import SERVED_NAME, stitchboard_cli
    from stitchboard.demo.lora_checks import wait_resident
    from stitchboard.demo.lora_demo import RESIDENT, SLOTS
    from stitchboard.demo.lora_engine import remove_handoff, start_lora_rollout
    from stitchboard.demo.processes import ProcessGroup, free_port
    from stitchboard.proto.adapter import adapter_name
    from stitchboard.trainer_client.publisher import Publisher
    from tests.support.shm import remove_orphaned_shm

    policy, states, rows, model_dir = _train(args.steps)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    rollout = None
    try:
        with ProcessGroup(work / "logs") as procs:
            port = free_port()
            bulletin_url = f"http://127.0.0.1:{port}"
            cmd = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{work / 'store'}", "--port", str(port)]
            procs.start("bulletin", cmd, f"{bulletin_url}/healthz").wait_healthy(120)
            rollout = start_lora_rollout(
                procs, model_dir, bulletin_url, RUN, slots=SLOTS, resident=RESIDENT, name=f"bench-lora-handoff-{port}"
            )
            start_s = rollout.engine.wait_healthy(900)
            print(f"engine with LoRA ready in {start_s:.0f} s", flush=True)
            time.sleep(2)
            rss = [_engine_rss(rollout.engine.proc.pid)]
            published, servable = [], []
            with Publisher(bulletin_url, RUN, workdir=work / "publisher") as publisher:
                for v in (0, 1):
                    t0 = time.perf_counter()
                    published.append(_published(publisher, policy, states[v], v))
                    wait_resident(rollout.url, adapter_name(RUN, v), 600)
                    if v:
                        servable.append(time.perf_counter() - t0)
                    time.sleep(1)
                    rss.append(_engine_rss(rollout.engine.proc.pid))
                per_adapter_mib = (rss[-1] - rss[0]) / 2 / 2**20
                print(f"engine RSS {rss[0] / 2**20:.0f} MiB before any adapter; after 1 and 2 resident: "
                      f"+{(rss[1] - rss[0]) / 2**20:.1f}, +{(rss[2] - rss[0]) / 2**20:.1f} MiB "
                      f"({per_adapter_mib:.1f} MiB per resident adapter)", flush=True)  # fmt: skip

                stream = BaseStream(rollout.url, SERVED_NAME)
                time.sleep(3)  # the stream under way
                t0 = time.perf_counter()
                time.sleep(args.window_s)
                t1 = time.perf_counter()
                for v in range(2, args.steps + 1):
                    t_pub = time.perf_counter()
                    published.append(_published(publisher, policy, states[v], v))
                    wait_resident(rollout.url, adapter_name(RUN, v), 600)
                    servable.append(time.perf_counter() - t_pub)
                    time.sleep(max(0.0, t_pub + args.every_s - time.perf_counter()))
                t2 = time.perf_counter()
                stream.stop()
            before_tps, before_gap = stream.window(t0, t1)
            during_tps, during_gap = stream.window(t1, t2)
            ratio = during_tps / before_tps
            status = rollout.status()
            print(f"base stream through the sidecar: {before_tps:.2f} tokens/s before (longest gap "
                  f"{before_gap * 1000:.0f} ms), {during_tps:.2f} tokens/s during {args.steps - 1} publishes + swaps "
                  f"over {t2 - t1:.1f} s (longest gap {during_gap * 1000:.0f} ms): ratio {ratio:.3f}; stream errors "
                  f"{stream.errors[:2]}; sidecar pauses {status.pause_seconds_by_route}", flush=True)  # fmt: skip
    finally:
        if rollout is not None:
            remove_handoff(rollout)
        remove_orphaned_shm()
        shutil.rmtree(work, ignore_errors=True)
    for p in published:
        print(json.dumps(p))
    print(f"publish -> servable per version 1..{args.steps} (s): {', '.join(f'{s:.2f}' for s in servable)}")
    print(f"adapter {rows[0]['adapter_bytes']} bytes; changed % per version {[r['changed_pct'] for r in rows]}; "
          f"cond patch / adapter {[r['patch_over_adapter'] for r in rows]}")  # fmt: skip
    patch_median = int(statistics.median(p["encoded_bytes"] for p in published[1:]))
    print(
        f"lora: versions={len(published) - 1} patch_bytes_median={patch_median} "
        f"servable_p50_s={statistics.median(servable):.3f} swap_tokens_ratio={ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
