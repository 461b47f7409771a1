"""One rank of the FSDP test of PublishCallback (``test_trl_fsdp.py``): a CPU gloo job, FSDP2 on a tiny Llama.

Run as ``python trl_fsdp_worker.py RENDEZVOUS_FILE BULLETIN_URL RUN [MODE]`` with ``RANK`` and ``WORLD_SIZE``
set. Every rank calls the callback's hooks as the Trainer does (train begin, one optimizer step, step end,
train end); rank 0 then checks that versions 0 and 1 at the bulletin are the served views of the
gathered full state dicts. ``MODE`` ``gather`` (default): only rank 0 made a publisher. ``shard_local``: every
rank made a ShardLocalPublisher, the callback gathered no full state dict (its gather is made to fail), the
sharded tensors' manifest entries carry parts, a commit the bulletin refused once (the test's fault proxy)
was retried on both ranks alike, and a trainer restarted behind the run is refused on both ranks alike.
Exits 0 on success.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState

from stitchboard.bulletin.client import BulletinClient
from stitchboard.trainer_client.errors import ResumeError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.shard_local import ShardLocalPublisher
from stitchboard.trainer_client.trl import callback as callback_module
from stitchboard.trainer_client.trl.callback import PublishCallback


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _no_gather(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    raise AssertionError("shard_local: the callback gathered the full state dict")


def _restarted_behind_the_run(url: str, run: str, rank: int, model: torch.nn.Module) -> None:
    """A trainer restarted from step 0's checkpoint is refused on every rank alike: rank 0 reads version 1's step
    and the ranks agree on it (rank 1's reads fail here, so a rank reading for itself would raise something else)."""

    def make() -> ShardLocalPublisher:
        publisher = ShardLocalPublisher(url, run, encoding="xor", retries=0, backoff_s=0.01)
        if rank == 1:

            def unreadable(*args: object, **kwargs: object) -> None:
                raise RuntimeError("rank 1 cannot read manifests")

            publisher.client.manifest = unreadable  # type: ignore[method-assign,assignment]
        return publisher

    callback = PublishCallback(make, shard_local=True)
    state, control = TrainerState(is_world_process_zero=rank == 0), TrainerControl()
    try:
        callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
    except ResumeError as exc:
        assert (exc.details["version"], exc.details["version_step"], exc.details["trainer_step"]) == (1, 1, 0)
    else:
        raise AssertionError(f"rank {rank}: a trainer behind the run was not refused")
    finally:
        if callback.publisher is not None:
            callback.publisher.close()


def main() -> int:
    rendezvous, url, run = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "gather"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    made = []
    if mode == "shard_local":
        callback_module.full_state_dict = _no_gather

        def make() -> ShardLocalPublisher:
            made.append(rank)
            return ShardLocalPublisher(url, run, encoding="xor", retries=0, backoff_s=0.01)

        callback = PublishCallback(make, shard_local=True, retry_interval_s=0.2)
    else:
        callback = PublishCallback(lambda: made.append(rank) or Publisher(url, run, encoding="xor"))
    state, control = TrainerState(is_world_process_zero=rank == 0), TrainerControl()
    callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
    before = full(model)
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()
    state.global_step = 1
    callback.on_step_end(None, state, control, model=model)  # type: ignore[arg-type]
    callback.on_train_end(None, state, control, model=model)  # type: ignore[arg-type]
    after = full(model)
    if mode == "shard_local":
        assert made == [rank] and isinstance(callback.publisher, ShardLocalPublisher)
        assert [p.version for p in callback.published] == [0, 1] and callback.skipped_steps == []
    if rank == 0:
        assert made == [0] and callback.publisher is not None
        with BulletinClient(url) as client:
            for version, sd in ((0, before), (1, after)):
                view, rebuilt = served_view(sd), rebuild_version(client, run, version).view
                if mode == "shard_local":  # the tied head is the embedding's parameter: published once, as it
                    head = view.pop("lm_head.weight")
                    assert head.bits.tobytes() == view["model.embed_tokens.weight"].bits.tobytes()
                assert set(view) == set(rebuilt), (version, sorted(set(view) ^ set(rebuilt)))
                for name in view:
                    assert view[name].bits.tobytes() == rebuilt[name].bits.tobytes(), (version, name)
                assert client.manifest(run, version).metadata["step"] == version
                if mode == "shard_local":
                    specs = client.manifest(run, version).tensor_map()
                    assert specs["model.embed_tokens.weight"].parts == [(0, 0, 20), (0, 20, 40)]
            assert not all(before[k].equal(after[k]) for k in before)  # the step changed the weights
    elif mode == "gather":
        assert made == [] and callback.publisher is None and callback.published == []
    if callback.publisher is not None:
        callback.publisher.close()
    if mode == "shard_local":
        _restarted_behind_the_run(url, run, rank, model)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
