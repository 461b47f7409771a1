"""``make example-miles``: Miles' disk-delta versions, published by stitchboard's Miles post-write hook, into real
SGLang through a sidecar; then checks what stitchboard promises.

This runs a Miles-FORMAT WRITER, not Miles (Miles is not on the package index and needs GPUs):
tests/trainer_client/miles_writer.py writes the folders Miles' ``--update-weight-transfer-mode disk-delta``
writes (radixark/miles 31f1ca9, ``update_weight_from_distributed/delta.py``), from real AdamW steps on the
demo's SmolLM2, and this process calls the hook as Miles' training rank 0 does:
``stitchboard.trainer_client.miles.post_write(args, version_dir, rollout_engines)``, first with the empty disk
dir (Miles' baseline), then with each ``weight_vNNNNNN`` folder. Runs a bulletin, one SGLang engine (CPU) and
its sidecar. Prints one ``ok <check>`` line per check, or ``FAIL <check>: why``; the last line is ``PASS`` or
``FAIL ...``; exit status 0 if and only if it is ``PASS``. Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the Miles-format writer and the CPU trainer live in the repository's tests/

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import SERVED_NAME, start_engine, stitchboard_cli
from stitchboard.demo.example_checks import run_checks
from stitchboard.demo.processes import ProcessGroup, free_port
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from stitchboard.trainer_client import miles
from stitchboard.trainer_client.errors import MilesDeltaError
from stitchboard.trainer_client.served_view import to_raw
from tests.support.training import CpuTrainer
from tests.trainer_client.miles_writer import INDEX_NAME, MILES_COMMIT, MilesWriter

RUN = "example-miles"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("stitchboard-example-miles"))
    parser.add_argument("--steps", type=int, default=3, help="trainer steps, each a Miles version folder")
    args = parser.parse_args(argv)
    print(
        f"this runs a Miles-format writer (tests/trainer_client/miles_writer.py, Miles {MILES_COMMIT[:7]}), not Miles"
    )
    try:
        return run_checks(lambda checks: run(args.workdir.resolve(), args.steps, checks))
    finally:
        miles.close_bridges()


def _applied(sidecar_url: str) -> int | None:
    return httpx.get(f"{sidecar_url}/v1/stitch/status", timeout=30).json().get("applied_version")


def run(workdir: Path, steps: int, checks: dict[str, str | None]) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_smollm2_checkpoint()
    stamp = int(time.time())
    delta_dir = workdir / f"miles-delta-{stamp}"  # Miles' --update-weight-disk-dir
    with ProcessGroup(workdir / "logs") as procs:
        port = free_port()
        bulletin_url = f"http://127.0.0.1:{port}"
        argv = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{workdir / f'store-{stamp}'}"]
        procs.start("bulletin", [*argv, "--port", str(port)], f"{bulletin_url}/healthz").wait_healthy(120)
        engine, engine_url = start_engine(procs, "engine-0", model_dir, kind="sglang")
        sidecar_port = free_port()
        sidecar_url = f"http://127.0.0.1:{sidecar_port}"
        handoff = workdir / f"handoff-{stamp}"
        argv = [
            *stitchboard_cli(), "sidecar", "run", "--bulletin", bulletin_url, "--run", RUN, "--engine", "sglang",
            "--engine-url", engine_url, "--port", str(sidecar_port), "--boot-version", "0",
            "--handoff-dir", str(handoff),
        ]  # fmt: skip
        procs.start("sidecar-0", argv, f"{sidecar_url}/health", env={"STITCH_SIDECAR_REQUEST_WAIT_S": "600"})
        engine.wait_healthy(600)

        # the hook's settings, as a Miles launch script exports them
        os.environ.update(
            {"STITCH_CLIENT_BULLETIN": bulletin_url, "STITCH_CLIENT_RUN": RUN, "STITCH_CLIENT_MILES_MIN_REPLICAS": "1"}
        )
        miles_args = Namespace(update_weight_disk_dir=str(delta_dir), hf_checkpoint=str(model_dir))
        writer = MilesWriter(delta_dir, model_dir, encoding="xor", checksum_format="xxh3-128", ranks=2)
        miles.post_write(miles_args, str(delta_dir), [])  # Miles' baseline
        checks["the hook published Miles' baseline (--hf-checkpoint) as version 0; the sidecar applied it"] = (
            None if _applied(sidecar_url) == 0 else f"the sidecar is at {_applied(sidecar_url)}"
        )

        trainer = CpuTrainer(model_dir, batch_size=1, seq_len=32)
        lagging = []
        for version in range(1, steps + 1):
            trainer.step()
            state = {n: t.detach().clone() for n, t in trainer.served_view().items()}
            folder = writer.write(state)
            miles.post_write(miles_args, str(folder), [])  # returns once the sidecar applied it
            if _applied(sidecar_url) != version:
                lagging.append(version)
        checks[f"the hook returned each of versions 1-{steps} only once the sidecar had applied it"] = (
            None if not lagging else f"not applied on return: {lagging}"
        )

        with BulletinClient(bulletin_url) as client:
            step_of = {v.version: client.manifest(RUN, v.version).metadata.get("step") for v in client.versions(RUN)}
            checks[
                f"Miles' versions 0-{steps} are the run's versions 0-{steps}, each recording Miles' version as step"
            ] = None if step_of == {v: v for v in range(steps + 1)} else f"bulletin versions -> steps {step_of}"
            want = {n: checksum(to_raw(t)) for n, t in state.items()}
            adapter = SglangEngine(engine_url, handoff / f"sidecar-{sidecar_port}" / "sglang-records", timeout_s=60)
            try:
                held = adapter.checksums(sorted(want))
            finally:
                adapter.close()
            checks["SGLang holds the trainer's bits of the last version, tensor by tensor (xxh3-128)"] = (
                None if held == want else f"{sum(held.get(n) != s for n, s in want.items())} tensors differ"
            )

            trainer.step()
            bad = writer.write({n: t.detach().clone() for n, t in trainer.served_view().items()})
            shard = min(bad.glob("model-*.safetensors"))
            data = bytearray(shard.read_bytes())
            data[-2] ^= 0x10  # one bit of a compressed delta
            shard.write_bytes(bytes(data))
            try:
                miles.post_write(miles_args, str(bad), [])
                refused = "the hook accepted it"
            except MilesDeltaError as exc:
                latest = client.latest(RUN)
                ok = shard.name in exc.message and latest == steps
                refused = None if ok else f"latest {latest}; {exc.message}"
            checks[f"a version folder with a corrupted shard ({INDEX_NAME} intact) is refused; nothing published"] = (
                refused
            )

        body = {"model": SERVED_NAME, "prompt": "Count from 1 to 5:", "max_tokens": 4, "temperature": 0}
        done = httpx.post(f"{sidecar_url}/v1/completions", json=body, timeout=600)
        stamp_end = done.headers.get("X-Stitch-Version-End")
        checks[f"a completion through the sidecar is stamped with version {steps}"] = (
            None if done.status_code == 200 and stamp_end == str(steps) else f"{done.status_code} {stamp_end}"
        )


if __name__ == "__main__":
    sys.exit(main())
