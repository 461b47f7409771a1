"""One rank of the 2-process shard-local publish tests (run through ranks.py, not collected by pytest).

Usage, with the torch.distributed env variables RANK and WORLD_SIZE set:
``python shard_local_worker.py MODES BULLETIN_URL RUN OUT_DIR``: each of the comma-separated MODES in turn, on
run ``RUN-MODE`` with files in ``OUT_DIR/MODE`` (one mode: on ``RUN``, in ``OUT_DIR``); a mode is one of:

* ``fsdp``: a small model with uneven and empty row shards (FSDP2 over gloo on the CPU), AdamW steps,
  a :class:`ShardLocalPublisher` publish after each (an anchor at 0 and 3); rank 0 writes each version's
  reference served view, gathered from the same ranks at the same step, into ``OUT_DIR/ref-{version}``.
* ``smollm2``: SmolLM2-135M under FSDP2 (``SMOLLM2_DIR``), real AdamW steps, a publish per step, squashes of
  depth 2.
* ``tp``: a model whose weights are DTensors placed ``Shard(0)`` and ``Shard(1)`` (tensor parallel) and a
  replicated norm; the same publishes and references; then the whole view given to ``publish_view`` is refused
  (the layout changed: no rank holds the sharded tensors' old bits whole).
* ``squash``: the ``tp`` model with squashes of depth 2 (each rank squashes its own pieces; a sharded tensor's
  parts meet at its writer), trained so that rank 1's rows of ``col.weight`` never change (a part with no
  change); before version 4 rank 1's record of its blocks is made wrong (the writer's check refuses squash
  2 -> 4), before version 5 the record of the replicated norm on its owner (that rank's own check refuses
  3 -> 5): both are skipped on both ranks and the versions stand.
* ``pipeline``: two pipeline stages, each holding its own layers whole and both the tied embedding; the
  second time the stages' embeddings differ and the publish is refused naming it (ReplicaMismatchError
  on both ranks, nothing committed); then they agree again and the next publish is that version.
* ``dies``: rank 1 exits in the middle of version 1's upload; rank 0's publish fails and commits nothing.
* ``hangs``: rank 1 hangs past the exchange timeout after its upload; both ranks' publishes fail, nothing is
  committed, and new publishers publish the version.
* ``after_death``: a fresh job (same run, ``resume="anchor"``) publishes the next version.
* ``resized``: a job of another world size resumes that run with ``resume="rebuild"`` and publishes deltas
  (``publish``, then ``publish_async``).

The ranks meet through a file store, ``OUT_DIR/rendezvous``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.trainer_client.errors import PublishError, ReplicaMismatchError
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.shard_local import ShardLocalPublisher

STEPS = 4


def uneven_model() -> torch.nn.Module:
    """Embedding [63, 16] (32 + 31 rows), Linear [47, 16] (24 + 23), Linear [1, 47] (1 + 0 rows: an empty shard)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(63, 16), torch.nn.Linear(16, 47), torch.nn.Linear(47, 1))


def train(model: torch.nn.Module, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def record(out: Path, version: int, reference: dict, result: object) -> None:
    if dist.get_rank() == 0:
        save_checkpoint(out / f"ref-{version}", reference)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(asdict(result)) + "\n")  # type: ignore[call-overload]


def fsdp(url: str, run: str, out: Path) -> None:
    model = uneven_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = train(model, list(model.parameters()))
    tokens = torch.randint(0, 63, (4, 8), generator=torch.Generator().manual_seed(0))
    with ShardLocalPublisher(url, run, snapshot_every=3, max_shard_bytes=2048) as pub:
        for step in range(STEPS):
            reference = served_view(model)  # the full weights, gathered from the same ranks at this step
            result = pub.publish(model, step=step)
            record(out, result.version, reference, result)
            opt.zero_grad()
            model(tokens).pow(2).mean().backward()
            opt.step()
        assert pub.layout_exchanges == 1, "the layout did not change: its records are exchanged once"


def smollm2(url: str, run: str, out: Path) -> None:
    """SmolLM2-135M (float32 masters, tied embedding) sharded by FSDP2, real AdamW steps on a fixed batch
    (``SMOLLM2_DIR``: the checkpoint folder); a publish before each step and after the last."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(os.environ["SMOLLM2_DIR"], dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6)
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with ShardLocalPublisher(url, run, snapshot_every=10, squash_depths=(2,)) as pub:
        for step in range(3):
            reference = served_view(model)  # the full weights, gathered from the same ranks at this step
            result = pub.publish(model, step=step)
            record(out, result.version, reference, result)
            opt.zero_grad()
            model(tokens, labels=tokens).loss.backward()
            opt.step()


def tp(url: str, run: str, out: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = {"col.weight": torch.randn(12, 10), "row.weight": torch.randn(9, 12), "norm.weight": torch.ones(12)}
    params = {
        "col.weight": distribute_tensor(full["col.weight"], mesh, [Shard(0)]),
        "row.weight": distribute_tensor(full["row.weight"], mesh, [Shard(1)]),
        "norm.weight": distribute_tensor(full["norm.weight"], mesh, [Replicate()]),
    }
    state = {n: torch.nn.Parameter(p) for n, p in params.items()}
    opt = torch.optim.AdamW(list(state.values()), lr=1e-2)
    with ShardLocalPublisher(url, run, snapshot_every=3) as pub:
        for step in range(STEPS):
            reference = served_view(state)
            result = pub.publish(state, step=step)
            record(out, result.version, reference, result)
            opt.zero_grad()
            sum((p.full_tensor() ** 2).sum() * (i + 1) for i, p in enumerate(state.values())).backward()
            opt.step()
        assert pub.layout_exchanges == 1  # the replicated norm's new digests went without its records
        with pytest.raises(PublishError, match="was sharded in the last version: the layout changed"):
            pub.publish_view(served_view(state))  # whole tensors now: no rank holds their old bits whole
        assert pub.layout_exchanges == 2  # a changed layout: the records exchanged again
        assert [i.version for i in pub.client.versions(run)] == list(range(STEPS))


def squash(url: str, run: str, out: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = {"col.weight": torch.randn(12, 10), "row.weight": torch.randn(9, 12), "norm.weight": torch.ones(12)}
    placements = {"col.weight": [Shard(0)], "row.weight": [Shard(1)], "norm.weight": [Replicate()]}
    state = {n: torch.nn.Parameter(distribute_tensor(t, mesh, placements[n])) for n, t in full.items()}
    opt = torch.optim.AdamW(list(state.values()), lr=1e-2, weight_decay=0.0)  # no gradient: no change
    with ShardLocalPublisher(url, run, snapshot_every=10, squash_depths=(2,)) as pub:
        for step in range(6):
            changes = pub._squasher.views._records[-1].changes if step >= 4 else {}  # the last version's record
            for name, (at, old) in changes.items():  # wrong old bits: rank 1's blocks, then the norm's owner's
                if (step == 4 and dist.get_rank() == 1 and name != "norm.weight") or (
                    step == 5 and name == "norm.weight"
                ):
                    old[: min(1, len(at))] ^= 1
            reference = served_view(state)
            result = pub.publish(state, step=step)
            record(out, result.version, reference, result)
            opt.zero_grad()
            col, row, norm = (p.full_tensor() for p in state.values())
            ((col[:6] ** 2).sum() + 2 * (row**2).sum() + 3 * (norm**2).sum()).backward()  # col's rows 6-11 stay
            opt.step()
        assert pub._squasher.stored == [(0, 2), (1, 3)], pub._squasher.stored  # 2 -> 4, 3 -> 5 skipped alike


def pipeline(url: str, run: str, out: Path) -> None:
    """Stage r holds layer r whole and the tied embedding; every tensor whole on its holders."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    embedding = torch.randn(16, 8)
    layers = [torch.randn(8, 8) for _ in range(dist.get_world_size())]
    state = {"model.embed_tokens.weight": embedding.clone(), f"model.layers.{rank}.weight": layers[rank].clone()}
    with ShardLocalPublisher(url, run) as pub:
        assert pub.publish(state, step=0).version == 0
        state["model.embed_tokens.weight"][3, 3] += 0.5 * (rank + 1)  # the stages' copies drift apart
        with pytest.raises(ReplicaMismatchError, match=r"'model.embed_tokens.weight' is replicated on ranks \[0, 1\]"):
            pub.publish(state, step=1)
        assert [i.version for i in pub.client.versions(run)] == [0]
        state["model.embed_tokens.weight"][3, 3] = embedding[3, 3] + 2.0  # synced again
        state[f"model.layers.{rank}.weight"][0, :] += 1.0
        result = pub.publish(state, step=1)
        assert result.version == 1
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, served_view(state))
        record(out, 1, {k: v for g in gathered for k, v in (g or {}).items()}, result)


def dies(url: str, run: str, out: Path) -> None:
    state = _sharded_state()
    with ShardLocalPublisher(url, run, timeout_s=10.0) as pub:
        pub.publish(state, step=0)
        state["w"].to_local().add_(0.25)
        if dist.get_rank() == 1:
            import stitchboard.trainer_client.shard_local as module

            real = module.upload_files

            def upload_then_die(*args: object, **kwargs: object) -> int:
                real(*args, **kwargs)  # type: ignore[arg-type]
                os._exit(17)  # after its part is uploaded, before the ranks exchange what they uploaded

            module.upload_files = upload_then_die  # type: ignore[assignment]
        with pytest.raises(PublishError, match="lost the other publishing ranks"):
            pub.publish(state, step=1)
        assert [i.version for i in pub.client.versions(run)] == [0]
    os._exit(0)  # the group lost rank 1: no barrier, no teardown (run this mode alone)


def hangs(url: str, run: str, out: Path) -> None:
    """Rank 1 hangs 3x the exchange timeout after its upload: rank 0's publish fails within the timeout (not gloo's
    30 minutes), rank 1's once it wakes; neither publisher takes another publish, and a new one publishes."""
    import stitchboard.trainer_client.shard_local as module

    state = _sharded_state()
    timeout_s = 5.0
    real = module.upload_files

    def upload_then_hang(*args: object, **kwargs: object) -> int:
        uploaded = real(*args, **kwargs)  # type: ignore[arg-type]
        time.sleep(3 * timeout_s)
        return uploaded

    with ShardLocalPublisher(url, run, exchange_timeout_s=timeout_s) as pub:
        pub.publish(state, step=0)
        state["w"].to_local().add_(0.25)
        if dist.get_rank() == 1:
            module.upload_files = upload_then_hang  # type: ignore[assignment]
        started = time.monotonic()
        with pytest.raises(PublishError, match=r"a peer hung past exchange_timeout_s=5 or died"):
            pub.publish(state, step=1)
        if dist.get_rank() == 0:
            assert time.monotonic() - started < 2.5 * timeout_s, "rank 0 waited past the exchange timeout"
        module.upload_files = real
        with pytest.raises(PublishError, match="exchanges failed before"):
            pub.publish(state, step=1)
        assert [i.version for i in pub.client.versions(run)] == [0]
    dist.barrier()  # the job meets again over its own group (intact): a new publisher's group waits the timeout only
    with ShardLocalPublisher(url, run, exchange_timeout_s=timeout_s, resume="rebuild") as pub:
        result = pub.publish(state, step=1)
        assert result.version == 1
        record(out, 1, served_view(state), result)


def after_death(url: str, run: str, out: Path) -> None:
    state = _sharded_state()
    state["w"].to_local().add_(0.5)
    with ShardLocalPublisher(url, run, resume="anchor") as pub:
        result = pub.publish(state, step=1)
        assert result.version == 1 and result.snapshot
        reference = served_view(state)
        record(out, 1, reference, result)


def resized(url: str, run: str, out: Path) -> None:
    """A job of another world size resumes the run (``resume="rebuild"``: every rank cuts its blocks from the
    rebuilt view) and publishes a delta, then one with ``publish_async``."""
    state = _sharded_state()
    state["w"].to_local().add_(0.5)
    with ShardLocalPublisher(url, run, resume="rebuild") as pub:
        assert pub.last_version == 1
        state["w"].to_local()[0].add_(1.0)
        result = pub.publish(state, step=2)
        assert (result.version, result.snapshot) == (2, False) and result.changed_elements > 0
        record(out, 2, served_view(state), result)
        state["w"].to_local()[-1].add_(1.0)
        reference = served_view(state)
        result = pub.publish_async(state, step=3).result()
        assert (result.version, result.snapshot) == (3, False)
        record(out, 3, reference, result)


def _sharded_state() -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    return {"w": distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)]), "b": torch.zeros(5)}


MODES = {
    "smollm2": smollm2,
    "fsdp": fsdp,
    "tp": tp,
    "squash": squash,
    "pipeline": pipeline,
    "dies": dies,
    "hangs": hangs,
    "after_death": after_death,
    "resized": resized,
}


def main(mode: str, url: str, run: str, out: Path) -> None:
    # a hung collective shows where, in rank{r}.stderr (SmolLM2's steps take minutes on 2 cores)
    faulthandler.dump_traceback_later(360 if "smollm2" in mode else 50, exit=True)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / ('rendezvous-' + mode)}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=60),
    )
    modes = mode.split(",")
    for one in modes:  # several modes in one job: each on run RUN-MODE, files in OUT_DIR/MODE
        folder = out / one if len(modes) > 1 else out
        folder.mkdir(exist_ok=True)
        MODES[one](url, f"{run}-{one}" if len(modes) > 1 else run, folder)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))
