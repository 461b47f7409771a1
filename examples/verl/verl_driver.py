"""verl's side of the example (run with .venv-verl's Python): verl's own CheckpointEngineManager on a local CPU Ray
cluster syncs real AdamW steps of SmolLM2 through the ``stitchboard`` checkpoint engine.

What is verl's and what is this script's:

* verl's: ``CheckpointEngineManager`` (the call order: abort, prepare, build_topology, init_process_group,
  send_weights + receive_weights concurrently, finalize, resume), ``CheckpointEngineRegistry`` and
  ``custom_backend_module`` loading, ``RayWorkerGroup``/``RayResourcePool``, its ``Worker`` dispatch, and on the
  rollout side its ``CheckpointEngineWorker`` (which builds the backend from the config as in a real run).
* this script's: the actor worker (a verl ``Worker`` holding SmolLM2 in float32 with AdamW on one fixed batch,
  building the backend as verl's ``ActorRolloutRefWorker`` does and sending ``get_per_tensor_param``-style
  ``(name, tensor)`` pairs), and the rollout replica: verl launches its own vLLM/SGLang servers in every mode, so
  the replica here has no server of its own; its engine is the real vLLM behind a stitchboard sidecar that the
  caller started, and its server adapter only takes the (empty) weight stream after the fleet wait.

Steps: ``update_weights(0)`` with the loaded weights (verl's ``on_init_end``), then per step an AdamW step and
``update_weights(k)``; at the end step ``--steps`` again with the same weights (a retried sync). Prints one JSON
line: per sync the version and whether it was new, the actor's served-view checksums after the last step, and
what each rollout-side worker saw.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.replica import RolloutReplica

from stitchboard.proto.codec import checksum
from stitchboard.trainer_client.served_view import served_view

TEXT = (
    "The lighthouse stood at the end of a long spit of sand, and for most of the year the keeper saw no one but "
    "the man who brought oil and flour on the first Monday of each month."
)


class ActorWorker(Worker):
    """verl's actor role, reduced to what weight sync needs: a model, AdamW, and the checkpoint engine."""

    def __init__(self, model_dir: str, config: dict[str, Any], lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.batch = AutoTokenizer.from_pretrained(model_dir)(TEXT, return_tensors="pt")["input_ids"][:, :32]
        ce = CheckpointEngineConfig(**config)
        import_external_libs(ce.custom_backend_module or None)  # as verl's ActorRolloutRefWorker does
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend,
            is_master=self.rank == 0,
            bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self) -> float:
        """One AdamW step on the fixed batch; returns the loss."""
        self.opt.zero_grad()
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        return float(loss)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def served_sums(self) -> dict[str, str]:
        """xxh3-128 of every tensor of the served view (bf16 cast) stitchboard publishes."""
        return {name: checksum(t) for name, t in served_view(self.model).items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def last_sync(self) -> dict[str, Any]:
        """What the backend did at the last sync."""
        return self.checkpoint_engine.last

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, float]:
        """As verl's actor: stream ``(name, tensor)`` pairs (``get_per_tensor_param``) into ``send_weights``."""
        params = ((name, p.detach()) for name, p in self.model.state_dict().items())
        return await self.checkpoint_engine.send_weights(params, global_steps=global_steps) or {}


class SidecarFacingAdapter:
    """The rollout-side server adapter: takes the backend's weight stream, which returns once the sidecars serve the
    step's version and carries no tensor (the sidecars pulled the version themselves)."""

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        async for name, _ in weights:
            raise AssertionError(f"step {global_steps}: a tensor ({name}) came through verl; none should")


class SidecarReplica(RolloutReplica):
    """One rollout replica whose engine is served behind a stitchboard sidecar (no verl-launched server): its one
    worker is verl's CheckpointEngineWorker, on a CPU resource pool."""

    def __init__(self, config: dict[str, Any]) -> None:  # RolloutReplica's constructor needs a full RolloutConfig
        self.replica_rank = 0
        self.rollout_config = {"checkpoint_engine": CheckpointEngineConfig(**config), "name": "stitchboard"}
        self.servers = []  # no verl-launched server: abort/resume/release_kv_cache act on none
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1, name_prefix="rollout")
        self.worker_group = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(CheckpointEngineWorker),
                rollout_config=_Config(self.rollout_config),
                model_config=None,
                server_adapter=SidecarFacingAdapter(),
            ),
            use_gpu=False,
            device_name="cpu",
            name_prefix="rollout",
        )
        self.workers = self.worker_group.workers

    async def launch_servers(self) -> None:
        """No server to launch: the engine is the caller's, behind its sidecar."""


class _Config:
    """Attribute access to the two rollout-config fields CheckpointEngineWorker reads (``checkpoint_engine``,
    ``name``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--bulletin", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    config = {
        "backend": "stitchboard",
        "custom_backend_module": "stitchboard.trainer_client.verl",
        "engine_kwargs": {
            "stitchboard": {"bulletin": args.bulletin, "run": args.run, "min_replicas": args.min_replicas}
        },
    }
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        actor_pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1, name_prefix="actor")
        actor = RayWorkerGroup(
            resource_pool=actor_pool,
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(ActorWorker), model_dir=args.model, config=config, lr=args.lr
            ),
            use_gpu=False,
            device_name="cpu",
            name_prefix="actor",
        )
        replica = SidecarReplica(config)
        manager = CheckpointEngineManager(CheckpointEngineConfig(**config), actor_wg=actor, replicas=[replica])
        manager.update_weights(global_steps=0)  # verl's on_init_end: the loaded weights
        syncs, losses = [actor.last_sync()[0]], []
        for step in range(1, args.steps + 1):
            losses.append(actor.train_step()[0])
            manager.update_weights(global_steps=step)
            syncs.append(actor.last_sync()[0])
        manager.update_weights(global_steps=args.steps)  # the last sync again: a retried manager
        syncs.append(actor.last_sync()[0])
        rollout = ray.get(replica.worker_group.execute_checkpoint_engine(["__getattribute__"], ["last"]))
        out = {"syncs": syncs, "losses": losses, "sums": actor.served_sums()[0], "rollout_last": rollout}
        print("VERL_DRIVER " + json.dumps(out), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
