"""One rank of the 2-process sharded-publish test (run by test_sharded.py, not collected by pytest).

Usage: ``python sharded_worker.py BULLETIN_URL RUN OUT_DIR STEPS`` with the torch.distributed
env variables RANK and WORLD_SIZE set; the ranks meet through a file store, ``OUT_DIR/rendezvous``
(no TCP port to pick, then find taken by another process). Builds a small model, shards it
with FSDP2 over gloo on the CPU, takes AdamW steps and publishes after each with
:class:`ShardedPublisher`; rank 0 writes each version's reference served view (gathered from
the shards) into ``OUT_DIR/ref-{version}`` and the results as JSON lines into ``OUT_DIR/results.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.sharded import ShardedPublisher


def main(url: str, run: str, out: Path, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.Linear(48, 32), torch.nn.LayerNorm(32))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = ShardedPublisher(url, run, snapshot_every=3, max_shard_bytes=4096, assets={"config.json": b'{"model_type": "toy"}'}, retries=1, backoff_s=0.01)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        result = publisher.publish(model, step=step)
        reference = served_view(model)  # collective gather of every DTensor
        if dist.get_rank() == 0:
            save_checkpoint(out / f"ref-{result.version}", reference)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(asdict(result)) + "\n")
        opt.zero_grad()
        model(tokens).pow(2).mean().backward()
        opt.step()
    publisher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
