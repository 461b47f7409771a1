"""TRL's GRPOTrainer with stitchboard on the CPU: per real step, what the trainer waits for and what it ships.

Run: ``python -m tests.benchmarks.bench_trl [--steps 5]`` (needs vLLM and TRL in the running
interpreter; exits 0 with a note when either is absent). One run, set up as ``make example-trl``
(``examples/trl/``): a bulletin on loopback, one vLLM server (CPU build, SmolLM2-135M, the worker
extension) behind a ``stitchboard sidecar run``, and TRL's ``GRPOTrainer`` (fp32 master weights,
8 completions a step in 2 groups of 4, 24 new tokens, AdamW) with :class:`PublishCallback` and
:class:`SidecarRollout` (staleness 0). Per optimizer step it prints:

* ``step_s``: the trainer's whole step (on_step_begin -> on_step_end), rollout included;
* ``rollout_s``: the ``rollout_func`` call (waiting for the last step's version, then generating);
* ``publish_block_s``: what the step waits for in the callback (the bf16 view taken on the
  training thread); ``publish_bg_s``: the background part (diff + encode, upload, commit);
* ``applied_s``: from the callback's call to the sidecar reporting the version applied (polled
  every 20 ms);
* ``patch_bytes`` vs ``full_bytes``: the step's patch vs a full bf16 state dict (what TRL's own
  vLLM sync ships each step).

Then, for comparison, one full reload through vLLM: the sidecar stopped, the last version pulled as
a full checkpoint and loaded in place through the adapter (pause, load + verify, resume), timed.
Last line::

    trl: steps=<n> publish_block_s=<median> applied_p50_s=<median> bytes_ratio_vs_full=<median patch / full>
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.vllm_server import vllm_importable

RUN = "bench-trl"


class AppliedWatch:
    """Polls a sidecar's status in a thread; keeps when each version was first seen applied (perf_counter)."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.wait(0.02):
                try:
                    applied = http.get("/v1/stitch/status").json().get("applied_version")
                except httpx.HTTPError:
                    continue
                if applied is not None and applied not in self.seen:
                    self.seen[applied] = time.perf_counter()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps measured")
    args = parser.parse_args()
    if not vllm_importable() or importlib.util.find_spec("trl") is None:
        print(
            "bench_trl: vLLM or TRL is not importable in this interpreter; "
            "run it with .venv/bin/python after `make venv`"
        )
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.demo.engines import start_rollout, stitchboard_cli
    from stitchboard.demo.processes import ProcessGroup, free_port
    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.demo.task import Prompt, prompts_for_step, reward
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from stitchboard.trainer_client.publisher import Publisher
    from stitchboard.trainer_client.resume import pull_version
    from stitchboard.trainer_client.trl.callback import PublishCallback
    from stitchboard.trainer_client.trl.rollout import SidecarRollout

    class TimedCallback(PublishCallback):
        """The PublishCallback, its on_step_end timed (what the step waits for)."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.begin: dict[int, float] = {}
            self.called: dict[int, float] = {}
            self.block: dict[int, float] = {}

        def on_step_begin(self, args, state, control, **kwargs) -> None:
            self.begin[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.called[state.global_step] = t = time.perf_counter()
            super().on_step_end(args, state, control, **kwargs)
            self.block[state.global_step] = time.perf_counter() - t

    class TimedRollout(SidecarRollout):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.seconds: dict[int, float] = {}

        def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
            t = time.perf_counter()
            out = super().__call__(prompts, trainer)
            self.seconds[trainer.state.global_step + 1] = time.perf_counter() - t
            return out

    def counting(completions: list[Any], n: list[int], **kwargs: Any) -> list[float]:
        return [reward(Prompt(k), c[0]["content"]) for c, k in zip(completions, n, strict=True)]

    torch.manual_seed(0)
    model_dir = build_smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-trl-"))
    try:
        with ProcessGroup(work / "logs") as procs:
            port = free_port()
            bulletin_url = f"http://127.0.0.1:{port}"
            argv = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{work / 'store'}", "--port", str(port)]
            procs.start("bulletin", argv, f"{bulletin_url}/healthz").wait_healthy(120)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            publisher = Publisher(bulletin_url, RUN, assets=model_dir, workdir=work / "publisher", encoding="xor")
            publisher.publish(model, step=0)
            rollout_proc = start_rollout(procs, 0, model_dir, bulletin_url, RUN, 0, work / "handoff-0")
            t = time.perf_counter()
            rollout_proc.engine.wait_healthy(600)
            rollout_proc.sidecar.wait_healthy(120)
            print(f"vLLM and sidecar ready in {time.perf_counter() - t:.1f} s")
            watch = AppliedWatch(rollout_proc.url)
            callback = TimedCallback(publisher)
            rollout = TimedRollout([rollout_proc.url], callback=callback, wait_s=300)
            prompts = [p for s in range(1, args.steps + 1) for p in prompts_for_step(s, 2)]
            from datasets import Dataset

            data = Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": p.message}] for p in prompts], "n": [p.n for p in prompts]}
            )
            config = GRPOConfig(
                output_dir=str(work / "trainer"), use_vllm=False, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=24, max_steps=args.steps, learning_rate=3e-6, beta=0.0, use_cpu=True,
                bf16=False, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
            )  # fmt: skip
            trainer = GRPOTrainer(
                model=model, reward_funcs=counting, args=config, train_dataset=data, processing_class=tokenizer,
                callbacks=[callback], rollout_func=rollout,
            )  # fmt: skip
            trainer.train()
            publisher.flush()
            rollout.close()
            results = {p.step: p for p in callback.published}
            last = max(p.version for p in callback.published if p.version is not None)
            deadline = time.monotonic() + 300
            while last not in watch.seen and time.monotonic() < deadline:
                time.sleep(0.05)
            watch.stop()
            rows = []
            client = BulletinClient(bulletin_url)
            for step in range(1, args.steps + 1):
                p = results[step]
                r = p.result
                assert r is not None and p.version is not None, f"step {step} was not published"
                rows.append(
                    {
                        "step": step,
                        "step_s": callback.called[step] - callback.begin[step],
                        "rollout_s": rollout.seconds.get(step, float("nan")),
                        "block_s": callback.block[step],
                        "bg_s": r.diff_s + r.write_s + r.upload_s + r.commit_s,
                        "applied_s": watch.seen.get(p.version, float("nan")) - callback.called[step],
                        "patch": r.encoded_bytes,
                        "full": r.view_bytes,
                        "changed": r.changed_fraction,
                    }
                )
                row = rows[-1]
                print(
                    f"step {step}: step {row['step_s']:.2f} s (rollout {row['rollout_s']:.2f} s) | publish: blocking "
                    f"{row['block_s']:.3f} s, background {row['bg_s']:.2f} s | publish -> applied "
                    f"{row['applied_s']:.2f} s | "
                    f"patch {row['patch'] / 1e6:.2f} MB vs full bf16 {row['full'] / 1e6:.1f} MB "
                    f"({row['changed']:.2%} changed)"
                )
            procs.stop(rollout_proc.sidecar)
            engine = VllmEngine(rollout_proc.engine.health_url.rsplit("/health", 1)[0], timeout_s=120)
            engine.take_lease("bench-trl", 120)
            pulled = work / "pulled"
            pull_version(client, RUN, pulled, last)
            shards = sorted(str(p) for p in pulled.glob("*.safetensors"))
            t = time.perf_counter()
            engine.pause()
            try:
                engine.load_snapshot(shards, last)
            finally:
                engine.resume()
            reload_s = time.perf_counter() - t
            print(
                f"one full reload through vLLM (pause, load {sum(Path(s).stat().st_size for s in shards) / 1e6:.0f} MB "
                f"in place + verify, resume): {reload_s:.2f} s"
            )
            client.close()
            publisher.close()
        block = statistics.median(r["block_s"] for r in rows)
        applied = statistics.median(r["applied_s"] for r in rows)
        ratio = statistics.median(r["patch"] / r["full"] for r in rows)
        print(
            f"medians: step {statistics.median(r['step_s'] for r in rows):.2f} s, rollout "
            f"{statistics.median(r['rollout_s'] for r in rows):.2f} s, publish background "
            f"{statistics.median(r['bg_s'] for r in rows):.2f} s, full reload {reload_s:.2f} s"
        )
        print(
            f"trl: steps={len(rows)} publish_block_s={block:.3f} applied_p50_s={applied:.3f} "
            f"bytes_ratio_vs_full={ratio:.4f}"
        )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
