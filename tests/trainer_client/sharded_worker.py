"""One rank of the 2-process sharded-publisher tests (run through ranks.py, not collected by pytest).

Usage, with the torch.distributed env variables RANK and WORLD_SIZE set:

* ``python sharded_worker.py steps BULLETIN_URL RUN OUT_DIR STEPS``: shards the toy model with
  FSDP2 over gloo on the CPU, takes AdamW steps and publishes after each with
  :class:`ShardedPublisher` (the last one with ``publish_view``; squashes of depth 2 on); rank 0 writes each version's
  reference served view (gathered from the shards) into ``OUT_DIR/ref-{version}`` and the
  results as JSON lines into ``OUT_DIR/results.jsonl``.
* ``python sharded_worker.py rank_failure BULLETIN_URL RUN OUT_DIR``: rank 1 cannot upload
  one version (:func:`rank_failure`).
* ``python sharded_worker.py SCENARIO BULLETIN_URL RUN OUT_DIR``: runs that scenario of
  publisher_scenarios.py on this rank, with a sharded publisher and an FSDP2-sharded trainer.

The ranks meet through a file store, ``OUT_DIR/rendezvous`` (no TCP port to pick, then find
taken by another process).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.trainer_client.errors import PublishError
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.sharded import ShardedPublisher
from tests.trainer_client.publisher_scenarios import SCENARIOS, Side, flaky_client
from tests.trainer_client.toy import ToyTrainer, assert_same_view


def shard(model: torch.nn.Module) -> None:
    """FSDP2 over every rank: each layer, then the whole model."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


SHARDED = Side(ShardedPublisher, lambda seed: ToyTrainer(seed, wrap=shard))


def publish_steps(url: str, run: str, out: Path, steps: int) -> None:
    trainer = SHARDED.trainer(0)
    publisher = ShardedPublisher(
        url,
        run,
        snapshot_every=3,
        max_shard_bytes=4096,
        assets={"config.json": b'{"model_type": "toy"}'},
        retries=1,
        backoff_s=0.01,
        squash_depths=(2,),
    )
    for step in range(steps):
        reference = served_view(trainer.model)  # collective gather of every DTensor
        result = (
            publisher.publish_view(reference, step=step)
            if step == steps - 1
            else publisher.publish(trainer.model, step=step)
        )
        if dist.get_rank() == 0:
            save_checkpoint(out / f"ref-{result.version}", reference)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(asdict(result)) + "\n")
        trainer.step()
    publisher.close()


def rank_failure(url: str, run: str, out: Path) -> None:
    """Rank 1 cannot upload version 1: every rank raises the same PublishError, nothing is
    committed, and the next publish (uploads back) is version 1."""
    trainer = SHARDED.trainer(0)
    down = {"on": False}

    def mode(request: httpx.Request) -> str | None:
        return "down" if down["on"] and dist.get_rank() == 1 and request.method == "PUT" else None

    client, _ = flaky_client(url, mode, retries=0)
    with ShardedPublisher(url, run, client=client) as pub:
        pub.publish(trainer.model)
        trainer.step()
        down["on"] = True
        with pytest.raises(PublishError, match=r"uploading version 1 of run .* failed on rank\(s\) \[1\]") as failed:
            pub.publish(trainer.model)
        assert failed.value.details["ranks"] == [1]
        assert [i.version for i in pub.client.versions(run)] == [0]
        down["on"] = False
        assert pub.publish(trainer.model).version == 1
        assert_same_view(rebuild_version(pub.client, run, 1).view, served_view(trainer.model))
    client.close()


def main(mode: str, url: str, run: str, out: Path, *rest: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'rendezvous'}",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=120),
    )
    if mode == "steps":
        publish_steps(url, run, out, int(rest[0]))
    elif mode == "rank_failure":
        rank_failure(url, run, out)
    else:
        (out / f"rank{rank}").mkdir()
        SCENARIOS[mode](SHARDED, url, run, out / f"rank{rank}")
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    # Interpreter shutdown after gloo collectives sometimes aborts in a C++ destructor
    # ("terminate called without an active exception"; see tests/sidecar/tp_agree_worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), *sys.argv[5:])
