"""The LoRA demo's engines: a vLLM with adapter slots behind a sidecar, and the oracle's fresh engine (demo process).

The sidecar is the same ``stitchboard sidecar run`` as the full-weights demo's: it finds the run is an
adapter run in its manifests and follows it as one (``sidecar/adapter_follower.py``), keeping
``--adapter-resident`` versions resident; its hand-off folder is on ``/dev/shm`` (memory-backed: no
adapter is written to a persistent disk on the serving side).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from stitchboard.proto.sidecar_wire import SidecarStatus
from stitchboard.sidecar.client import SidecarClient
from stitchboard.sidecar.engines.launch import engine_nice
from stitchboard.sidecar.engines.vllm.launch import vllm_command, vllm_env

from .engines import SERVED_NAME, stitchboard_cli
from .lora_policy import LORA_RANK
from .processes import ManagedProcess, ProcessGroup, free_port

#: The memory-backed folder the sidecar's hand-off folders go under (when the host has one).
SHM = Path("/dev/shm")


@dataclass
class LoraRollout:
    """The adapter engine and its sidecar (``url``: the only address clients use)."""

    engine: ManagedProcess
    sidecar: ManagedProcess
    url: str
    handoff_dir: Path

    def status(self) -> SidecarStatus:
        """The sidecar's ``/v1/stitch/status``."""
        with SidecarClient(self.url, timeout_s=10) as client:
            return client.status()


def lora_engine(
    procs: ProcessGroup,
    name: str,
    model_dir: Path,
    *,
    slots: int,
    modules: dict[str, Path] | None = None,
    extension: bool = False,
) -> tuple[ManagedProcess, str]:
    """Start a vLLM serving ``model_dir`` as :data:`.engines.SERVED_NAME` with ``slots`` LoRA slots (rank up to
    :data:`.lora_policy.LORA_RANK`), niced on a CPU host; returns it and its URL (not yet healthy).

    Args:
        modules: adapter name -> PEFT folder, each loaded from disk at start (``--lora-modules``): the oracle.
        extension: with stitchboard's worker extension (the sidecar's engine; False: a plain engine).
    """
    port = free_port()
    argv = vllm_command(
        model_dir, port, served_model_name=SERVED_NAME, extension=extension, max_loras=slots, max_lora_rank=LORA_RANK
    )
    if modules:
        argv += ["--lora-modules", *(f"{adapter}={folder}" for adapter, folder in modules.items())]
    url = f"http://127.0.0.1:{port}"
    return procs.start(name, argv, f"{url}/health", env=vllm_env(lora=True), nice=engine_nice()), url


def start_lora_rollout(
    procs: ProcessGroup, model_dir: Path, bulletin_url: str, run: str, *, slots: int, resident: int, name: str
) -> LoraRollout:
    """Start the adapter engine (``slots`` slots, the worker extension) and a sidecar following adapter run ``run``
    with ``resident`` versions resident; its hand-off folder ``name`` is made under :data:`SHM` (else the log folder's
    parent) and removed by :func:`remove_handoff`."""
    engine, engine_url = lora_engine(procs, "engine-lora", model_dir, slots=slots, extension=True)
    handoff = (SHM if SHM.is_dir() else procs.log_dir.parent) / name
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        *stitchboard_cli(), "sidecar", "run", "--bulletin", bulletin_url, "--run", run, "--engine", "vllm",
        "--engine-url", engine_url, "--port", str(port), "--handoff-dir", str(handoff),
        "--adapter-resident", str(resident),
    ]  # fmt: skip
    sidecar = procs.start("sidecar-lora", argv, f"{url}/health")
    return LoraRollout(engine, sidecar, url, handoff)


def remove_handoff(rollout: LoraRollout) -> None:
    """Remove the sidecar's hand-off folder (after the sidecar stopped)."""
    shutil.rmtree(rollout.handoff_dir, ignore_errors=True)
