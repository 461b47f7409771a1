"""Sharded publish at 1, 2 and 4 ranks: the shard-local path against today's gather path, in one run.

Run: ``python -m tests.benchmarks.bench_sharded [--view-mb 1024] [--tensor-mb 16] [--ranks 1,2,4]`` (from the
repo root, in .venv; memory-hungry: each rank holds its shard of the model, the shard-local publisher's kept
blocks and the gather path's kept tensors, ~1 GB per rank at 4 ranks and 1 GB; run it under the heavy lock).

Per rank count: ``--ranks`` processes (torch.distributed, gloo, CPU) each hold their rows of a synthetic bf16
model of ``--view-mb`` MB (tensors of ``--tensor-mb`` MB, DTensors placed ``Shard(0)``: what FSDP2 holds),
publish version 0 with both publishers (:class:`ShardLocalPublisher` and :class:`ShardedPublisher`, each on
its own run of one bulletin in another process, file store), give 1 % of their elements new random values
(the density measured on real RL steps) and publish one delta with each. For each delta call, per rank:

* RSS growth during the call (high-water mark reset first, as ``bench_view_memory``) over the rank's shard
  of the served view, plus 1 for the kept copy (``rank_rss_over_shard``);
* payload bytes the rank received from the other ranks through ``torch.distributed``, counted by a wrapper
  around the calls the publishers make (``all_gather_object``, ``broadcast_object_list``: pickled size of
  the other ranks' objects; ``recv``, ``irecv``: the tensor's bytes; ``DTensor.full_tensor``: the full tensor
  less the local shard), summed over the ranks;
* seconds (the slowest rank's).

Then rank 0 pulls the shard-local run's delta version (rebuilt from the bulletin) and compares it bit for bit
with the full weights gathered from the same ranks at the same step. The fixed cost is the intercept of a
least-squares line through (shard MB, largest rank RSS growth MB) over the rank counts. Last, the
single-process streamed publish (``bench_view_memory``'s) of the same model gives ``single_rss_over_view``.
Last line::

    sharded: ranks=4 max_rank_rss_over_shard=<x> fixed_cost_mb=<n> single_rss_over_view=<x>
    bytes_between_ranks=<n> gather_path_bytes=<n> bit_exact=<true|false>

Targets (issue #32): max_rank_rss_over_shard <= 1.3, single_rss_over_view <= 1.15, bytes_between_ranks under
1 % of gather_path_bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.shard_local import ShardLocalPublisher
from stitchboard.trainer_client.sharded import ShardedPublisher
from tests.benchmarks.bench_view_memory import M_MMAP_THRESHOLD, measure, rl_step, synthetic_state
from tests.bulletin.bulletin_helpers import ProcessServer
from tests.support.pythonpath import repo_on_pythonpath

COLS = 1024


class ByteCounter:
    """Counts the payload bytes this rank receives through the ``torch.distributed`` calls the publishers make."""

    def __init__(self) -> None:
        self.received = 0
        self.on = False
        self._wrap()

    def _wrap(self) -> None:
        from torch.distributed.tensor import DTensor

        gather_object, broadcast_objects = dist.all_gather_object, dist.broadcast_object_list
        recv, irecv = dist.recv, dist.irecv
        full_tensor = DTensor.full_tensor
        counter = self

        def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
            gather_object(out, obj, group=group)
            if counter.on:
                me = dist.get_rank(group)
                counter.received += sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != me)

        def broadcast_object_list(objs: list[Any], *args: Any, **kwargs: Any) -> None:
            broadcast_objects(objs, *args, **kwargs)
            group, src = kwargs.get("group"), kwargs.get("group_src", 0)
            if counter.on and dist.get_rank(group) != src:
                counter.received += len(pickle.dumps(objs))

        def recv_counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = recv(tensor, *args, **kwargs)
            if counter.on:
                counter.received += tensor.numel() * tensor.element_size()
            return out

        def irecv_counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.on:  # counted when posted: the publishers wait for every receive they post
                counter.received += tensor.numel() * tensor.element_size()
            return irecv(tensor, *args, **kwargs)

        def full_tensor_counted(self: DTensor, **kwargs: Any) -> torch.Tensor:
            full = full_tensor(self, **kwargs)
            if counter.on:
                local = self.to_local()
                counter.received += (full.numel() - local.numel()) * full.element_size()
            return full

        dist.all_gather_object = all_gather_object  # type: ignore[assignment]
        dist.broadcast_object_list = broadcast_object_list  # type: ignore[assignment]
        dist.recv = recv_counted  # type: ignore[assignment]
        dist.irecv = irecv_counted  # type: ignore[assignment]
        DTensor.full_tensor = full_tensor_counted  # type: ignore[method-assign]

    def count(self, call: Callable[[], object]) -> int:
        """Bytes received during ``call``."""
        self.received, self.on = 0, True
        try:
            call()
        finally:
            self.on = False
        return self.received


def rank_state(view_mb: int, tensor_mb: int, step: int = 0) -> dict[str, torch.Tensor]:
    """This rank's rows of the synthetic model (DTensors placed ``Shard(0)``), one full tensor made at a time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    gen = torch.Generator().manual_seed(0)
    rows = max(1, tensor_mb * 2**20 // (2 * COLS))
    for i in range(max(1, view_mb // tensor_mb)):
        full = torch.randn(rows, COLS, generator=gen).to(torch.bfloat16)
        local = full.chunk(world)[rank].clone()
        del full
        out[f"model.layers.{i}.mlp.up_proj.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def rank_worker(out: Path, url: str, view_mb: int, tensor_mb: int) -> None:
    """One rank: both publishers, version 0 then one measured delta each; figures into ``out/rank{r}.json``."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    counter = ByteCounter()
    state = rank_state(view_mb, tensor_mb)
    shard_bytes = sum(t.to_local().numel() * 2 for t in state.values())
    figures: dict[str, Any] = {"shard_bytes": shard_bytes}
    work = out / f"work{rank}"
    with (
        ShardLocalPublisher(url, "local", snapshot_every=1000, workdir=work) as local,
        ShardedPublisher(url, "gather", snapshot_every=1000, workdir=work) as gather,
    ):
        local.publish(state, step=0)
        gather.publish(state, step=0)
        local_state = {n: t.to_local() for n, t in state.items()}
        rl_step(local_state, 1 + rank)  # each rank changes its own rows
        for name, pub in (("local", local), ("gather", gather)):
            dist.barrier()
            received: list[int] = []
            m = measure(lambda p=pub, got=received: got.append(counter.count(lambda: p.publish(state, step=1))))
            figures[name] = {"growth_bytes": m.growth_bytes, "seconds": m.seconds, "received_bytes": received[0]}
        reference = served_view(state)  # the full weights gathered from the same ranks at the same step
        if rank == 0:
            pulled = rebuild_version(local.client, "local", 1, workdir=work).view
            figures["bit_exact"] = set(pulled) == set(reference) and all(
                np.array_equal(pulled[n].bits, reference[n].bits) for n in reference
            )
        del reference
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_ranks(world: int, view_mb: int, tensor_mb: int) -> list[dict[str, Any]]:
    """Both publishers at ``world`` ranks against a fresh bulletin; each rank's figures."""
    store = tempfile.mkdtemp(prefix="bench-sharded-store-")
    out = Path(tempfile.mkdtemp(prefix="bench-sharded-ranks-"))
    server = ProcessServer(BulletinSettings(store=f"file://{store}"))
    try:
        env = {**os.environ, **repo_on_pythonpath(), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "tests.benchmarks.bench_sharded", "--rank-worker", str(out), server.url]
        cmd += ["--view-mb", str(view_mb), "--tensor-mb", str(tensor_mb)]
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(world)]
        codes = [p.wait(1800) for p in procs]
        if codes != [0] * world:
            raise RuntimeError(f"ranks exited {codes}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        server.kill()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def single_process(view_mb: int, tensor_mb: int) -> float:
    """Peak RSS over the view of one streamed delta publish by the single-process Publisher."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    state = synthetic_state(view_mb, tensor_mb)
    view_bytes = sum(t.numel() * 2 for t in state.values())
    store, work = tempfile.mkdtemp(prefix="bench-sharded-store-"), tempfile.mkdtemp(prefix="bench-sharded-work-")
    server = ProcessServer(BulletinSettings(store=f"file://{store}"))
    try:
        with Publisher(server.url, "single", snapshot_every=1000, workdir=work) as pub:
            pub.publish(state, step=0)
            rl_step(state, 1)
            m = measure(lambda: pub.publish(state, step=1))
    finally:
        server.kill()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    growth_mb, view_mb_measured = m.growth_bytes / 2**20, view_bytes / 2**20
    print(f"single process: rss growth {growth_mb:.1f} MB over a {view_mb_measured:.0f} MB view, {m.seconds:.2f} s")
    return 1 + m.growth_bytes / view_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--view-mb", type=int, default=1024, help="model size, MB of bf16 (default 1024)")
    parser.add_argument("--tensor-mb", type=int, default=16, help="size of each tensor, MB (default 16)")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated (default 1,2,4)")
    parser.add_argument("--rank-worker", nargs=2, metavar=("OUT", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(Path(args.rank_worker[0]), args.rank_worker[1], args.view_mb, args.tensor_mb)
        return
    header = ("ranks", "path", "shard MB", "max rss/shard", "growth MB", "bytes between ranks", "seconds")
    print("{:>5} {:<7} {:>9} {:>13} {:>10} {:>20} {:>8}".format(*header))
    points: list[tuple[float, float]] = []
    last: dict[str, Any] = {}
    for world in [int(w) for w in args.ranks.split(",")]:
        ranks = run_ranks(world, args.view_mb, args.tensor_mb)
        shard = max(r["shard_bytes"] for r in ranks)
        for path in ("local", "gather"):
            growth = max(r[path]["growth_bytes"] for r in ranks)
            ratio = max(1 + r[path]["growth_bytes"] / r["shard_bytes"] for r in ranks)
            moved = sum(r[path]["received_bytes"] for r in ranks)
            seconds = max(r[path]["seconds"] for r in ranks)
            row = (world, path, shard / 2**20, ratio, growth / 2**20, moved, seconds)
            print("{:>5} {:<7} {:>9.0f} {:>13.3f} {:>10.1f} {:>20} {:>8.2f}".format(*row))
        points.append((shard / 2**20, max(r["local"]["growth_bytes"] for r in ranks) / 2**20))
        last = {
            "ranks": world,
            "ratio": max(1 + r["local"]["growth_bytes"] / r["shard_bytes"] for r in ranks),
            "local_bytes": sum(r["local"]["received_bytes"] for r in ranks),
            "gather_bytes": sum(r["gather"]["received_bytes"] for r in ranks),
            "bit_exact": ranks[0]["bit_exact"],
        }
    if len(points) > 1:
        slope, fixed = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
        print(f"rss growth MB ~ {slope:.3f} x shard MB + {fixed:.0f}")
    else:
        fixed = 0.0
    single = single_process(args.view_mb, args.tensor_mb)
    print(
        f"sharded: ranks={last['ranks']} max_rank_rss_over_shard={last['ratio']:.3f} fixed_cost_mb={fixed:.0f} "
        f"single_rss_over_view={single:.3f} bytes_between_ranks={last['local_bytes']} "
        f"gather_path_bytes={last['gather_bytes']} bit_exact={str(last['bit_exact']).lower()}"
    )


if __name__ == "__main__":
    main()
