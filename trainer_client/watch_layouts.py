"""The checkpoint folders ``stitchboard watch`` follows: layouts, when a checkpoint is complete, and
reading one whole (trainer host, the watcher's process).

A layout names a framework's checkpoint folders, the step in each name, and when one is complete
(docs/integrations/watch.md says where each was read in the framework's code):

* ``prime-rl``: ``DIR/step_N/`` (DIR is prime-rl's ``<output_dir>/broadcasts``), written by its
  filesystem weight broadcast (``model.safetensors``, or shards and ``model.safetensors.index.json``,
  bf16), complete once the empty ``STABLE`` file it touches last exists;
* ``nemo-rl``: ``DIR/version_N/``, full exports moved into place by an atomic rename: complete
  as soon as the name exists;
* ``hf-trainer``: ``DIR/checkpoint-N/`` (``Trainer._save_checkpoint``: the model, then optimizer,
  scheduler and RNG state, then ``trainer_state.json`` last), complete once ``trainer_state.json``
  exists and every shard the index lists is present;
* ``miles``: ``DIR/weight_vNNNNNN/`` (DIR is Miles' ``--update-weight-disk-dir``), disk-delta versions, each
  complete once ``model.safetensors.index.json`` (written last, by rank 0) and every shard it lists exist;
  each is decoded on the version before it (:mod:`.miles_delta`), version 0 being Miles'
  ``--hf-checkpoint`` (:func:`miles_layout`);
* a custom one: ``--pattern GLOB`` (the step is the last number in the name), complete once
  ``--complete-marker FILE`` exists in it, or once its files stay unchanged ``--settle-s`` seconds.

A complete checkpoint is read whole into memory (:func:`read_stable`), not memory-mapped (a file
rewritten in place under a map faults the process), and its files' size, modification time and
inode are compared before and after the read: a checkpoint changed or deleted meanwhile is
refused (:class:`CheckpointChangedError`, :class:`CheckpointGoneError`), never half read.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from stitchboard.proto.checkpoint import INDEX_NAME, SINGLE_NAME, checkpoint_files
from stitchboard.proto.container import RawTensor, parse_safetensors
from stitchboard.proto.errors import PatchFormatError

from .errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointGoneError,
    CheckpointRefusedError,
    WatchLayoutError,
)
from .miles_delta import FOLDER as MILES_FOLDER
from .miles_delta import INDEX_NAME as MILES_INDEX
from .miles_delta import MilesView

_LAST_NUMBER = re.compile(r"(\d+)\D*$")
#: A pickle an HF checkpoint folder always holds beside the weights (the TrainingArguments), not weights.
_NOT_WEIGHTS = frozenset({"training_args.bin"})


@dataclass(frozen=True)
class Layout:
    """How one framework names its checkpoint folders and says one is complete.

    Attributes:
        name: ``prime-rl``, ``nemo-rl``, ``hf-trainer``, or ``pattern`` for ``--pattern``.
        folders: regular expression a checkpoint folder's whole name matches.
        marker: a file whose presence in the folder says the checkpoint is complete (None: the
            folder's name appearing says it: an atomic rename, or ``settle_s``).
        index_complete: also wait until every shard the folder's index lists is present.
        example: a folder name of the layout, for messages (``step_N``).
        reader: reads a complete folder's view (None: :func:`read_stable`, a full checkpoint).
    """

    name: str
    folders: re.Pattern[str]
    marker: str | None = None
    index_complete: bool = False
    example: str = ""
    reader: Callable[[Path], dict[str, RawTensor]] | None = None

    def read(self, folder: Path) -> dict[str, RawTensor]:
        """The view of a complete folder: its ``reader``'s, else :func:`read_stable`'s (errors: theirs)."""
        return self.reader(folder) if self.reader is not None else read_stable(folder)

    def step_of(self, name: str) -> int | None:
        """The step of a folder named ``name``; None when the name is not one of this layout's."""
        if not self.folders.fullmatch(name):
            return None
        number = _LAST_NUMBER.search(name)
        return int(number.group(1)) if number else None

    def is_complete(self, folder: Path) -> bool:
        """Whether the framework finished writing ``folder`` (its marker, and the index's shards)."""
        if self.marker is not None and not (folder / self.marker).is_file():
            return False
        if self.index_complete and (folder / INDEX_NAME).is_file():
            try:
                weight_map, _ = checkpoint_files(folder / INDEX_NAME)
            except (OSError, PatchFormatError):
                return True  # read, and refused naming the index
            return all((folder / shard).is_file() for shard in set(weight_map.values()))
        return True


#: The frameworks' layouts, by name.
LAYOUTS: dict[str, Layout] = {
    "prime-rl": Layout("prime-rl", re.compile(r"step_(\d+)"), marker="STABLE", example="step_N"),
    "nemo-rl": Layout("nemo-rl", re.compile(r"version_(\d+)"), example="version_NNNNNNNN"),
    "hf-trainer": Layout(
        "hf-trainer",
        re.compile(r"checkpoint-(\d+)"),
        marker="trainer_state.json",
        index_complete=True,
        example="checkpoint-N",
    ),
}


def pattern_layout(glob: str, marker: str | None) -> Layout:
    """A custom layout: folders matching ``glob`` (fnmatch), the step the last number in the name."""
    return Layout("pattern", re.compile(fnmatch.translate(glob)), marker=marker, example=glob)


def miles_layout(base: Path) -> Layout:
    """Miles' disk-delta folders (``weight_vNNNNNN/``), decoded from ``base`` (Miles' ``--hf-checkpoint``) on.

    The layout keeps the last decoded view (one per watcher): each folder is decoded on the one before it,
    replayed from ``base`` when the watcher starts after a version (:class:`~.miles_delta.MilesView`).
    """
    view = MilesView(lambda: read_stable(base))
    return Layout(
        "miles", MILES_FOLDER, marker=MILES_INDEX, index_complete=True, example="weight_vNNNNNN", reader=view.read
    )


def checkpoints(root: Path, layout: Layout) -> list[tuple[int, Path]]:
    """The folders of ``layout`` in ``root`` as (step, folder), by step (a missing ``root``: none)."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        step = layout.step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, Path(entry.path)))
    return sorted(found)


def choose_layout(root: Path, wanted: Layout | None) -> Layout | None:
    """The layout to follow in ``root``: ``wanted``, or (None: auto) the one framework layout found.

    Returns:
        The layout; None in auto mode while ``root`` holds no checkpoint folder yet.

    Raises:
        WatchLayoutError: ``root`` holds folders of another framework's layout and none of
            ``wanted``'s, or (auto) of several layouts; the message names them.
    """
    found = {name: [p.name for _, p in checkpoints(root, layout)] for name, layout in LAYOUTS.items()}
    found = {name: names for name, names in sorted(found.items()) if names}
    if wanted is not None:
        if checkpoints(root, wanted) or not found or wanted.name in found:
            return wanted
        other, names = next(iter(found.items()))
        raise WatchLayoutError(
            f"{root} holds {other} checkpoints ({', '.join(names[:3])}), not {wanted.name}'s {wanted.example}/: "
            f"watch it with --layout {other} (or --layout auto)",
            folder=str(root),
            found=other,
        )
    if len(found) > 1:
        listed = "; ".join(f"{name}: {', '.join(names[:3])}" for name, names in found.items())
        raise WatchLayoutError(
            f"{root} holds checkpoints of several layouts ({listed}): name the one to publish with --layout",
            folder=str(root),
            found=sorted(found),
        )
    return LAYOUTS[next(iter(found))] if found else None


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of one checkpoint folder.

    Attributes:
        folder: the checkpoint folder.
        weight_map: tensor name -> shard file name (from the index); empty for a single file.
        files: the safetensors files to read (sorted), then the index when there is one.
    """

    folder: Path
    weight_map: dict[str, str]
    files: tuple[Path, ...]


def _refuse_other_formats(folder: Path, names: list[str]) -> NoReturn:
    """Raise for a folder without safetensors weights, naming what it holds instead."""
    where = str(folder)
    if "adapter_config.json" in names:
        raise CheckpointRefusedError(
            f"{folder / 'adapter_config.json'}: a PEFT adapter, not full weights; watch publishes full weights only: "
            "publish the PeftModel from the trainer with Publisher.publish(peft_model), which makes an adapter run "
            "(docs/adapters.md), or merge it into the model (merge_and_unload()) and save that",
            folder=where,
        )
    distcp = sorted(folder.glob("*.distcp")) + sorted(folder.glob("*/*.distcp"))
    if distcp:
        raise CheckpointRefusedError(
            f"{distcp[0]}: FSDP/DCP sharded state (torch.distributed.checkpoint), not a full state dict; save one: "
            "HF Trainer/accelerate fsdp_config state_dict_type FULL_STATE_DICT (accelerate: fsdp_state_dict_type: "
            "FULL_STATE_DICT), NeMo-RL checkpointing.save_consolidated: true, or torch get_model_state_dict("
            "model, options=StateDictOptions(full_state_dict=True)) saved with save_pretrained",
            folder=where,
        )
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")) and n not in _NOT_WEIGHTS)
    weights = [n for n in pickles if "model" in n] or pickles
    if weights:
        raise CheckpointRefusedError(
            f"{folder / weights[0]}: pickled weights (torch.save), which run code when loaded; save safetensors: "
            "save_pretrained(safe_serialization=True), TrainingArguments(save_safetensors=True)",
            folder=where,
        )
    raise CheckpointRefusedError(
        f"{folder}: no weights ({SINGLE_NAME}, {INDEX_NAME} or one .safetensors file); it holds "
        f"{', '.join(names[:8]) or 'nothing'} (prime-rl's NCCL broadcast writes only STABLE: use its filesystem "
        "broadcast)",
        folder=where,
    )


def weight_files(folder: Path) -> WeightFiles:
    """Find a checkpoint folder's weights: an index and its shards, or one safetensors file.

    Raises:
        CheckpointGoneError: the folder does not exist (any more).
        CheckpointRefusedError: a PEFT adapter, DCP shards, pickles, or no weights (see the module docstring).
        CheckpointError: several safetensors files without an index, a malformed index, or a shard it lists absent.
    """
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        raise CheckpointGoneError(f"{folder} was deleted", folder=str(folder)) from None
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if "adapter_config.json" in names or not (safetensors or INDEX_NAME in names):
        _refuse_other_formats(folder, names)
    if INDEX_NAME not in names and SINGLE_NAME not in names and len(safetensors) > 1:
        raise CheckpointError(
            f"{folder}: {len(safetensors)} .safetensors files ({', '.join(safetensors[:3])}...) and no {INDEX_NAME}",
            folder=str(folder),
        )
    try:
        weight_map, _ = checkpoint_files(folder)
    except PatchFormatError as exc:
        raise CheckpointError(exc.message, folder=str(folder)) from None
    except FileNotFoundError:
        raise CheckpointGoneError(f"{folder}: its weights were deleted", folder=str(folder)) from None
    if not weight_map:
        return WeightFiles(folder, {}, (folder / (SINGLE_NAME if SINGLE_NAME in names else safetensors[0]),))
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if s not in names]
    if missing:
        raise CheckpointError(
            f"{folder / INDEX_NAME} lists {len(shards)} shards; {', '.join(missing[:3])} absent", folder=str(folder)
        )
    return WeightFiles(folder, weight_map, tuple(folder / s for s in shards) + (folder / INDEX_NAME,))


def fingerprint(paths: tuple[Path, ...]) -> tuple[tuple[str, int, int, int], ...]:
    """(name, size in bytes, modification time in ns, inode) of each file: changes when one is rewritten.

    Raises:
        CheckpointGoneError: a file was deleted.
    """
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise CheckpointGoneError(f"{p} was deleted", folder=str(p.parent)) from None
        out.append((p.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def read_shard(path: Path) -> dict[str, RawTensor]:
    """Read one safetensors file whole into memory and parse it strictly (writable views of the bytes).

    Raises:
        CheckpointGoneError: the file was deleted. CheckpointChangedError: it shrank while read.
        PatchFormatError: malformed or truncated, naming the file.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            got = f.readinto(buf)
    except FileNotFoundError:
        raise CheckpointGoneError(f"{path} was deleted while read", folder=str(path.parent)) from None
    if got != size:
        raise CheckpointChangedError(f"{path} changed size while read", folder=str(path.parent))
    if size == 0:
        raise PatchFormatError(f"{path}: empty file")
    return parse_safetensors(buf, what=str(path))[1]


def read_stable(folder: Path) -> dict[str, RawTensor]:
    """Read a complete checkpoint's tensors (name -> raw tensor over an in-memory copy), checking that
    no weight file changed or vanished across the read (see the module docstring).

    Raises:
        CheckpointGoneError, CheckpointChangedError: deleted or changed while read; nothing is returned.
        CheckpointRefusedError, CheckpointError: see :func:`weight_files`; a tensor in two shards, or not
            where the index says.
        PatchFormatError: a malformed or truncated file, naming it.
    """
    files = weight_files(folder)
    before = fingerprint(files.files)
    out: dict[str, RawTensor] = {}
    for path in files.files:
        if path.name == INDEX_NAME:
            continue
        for name, tensor in read_shard(path).items():
            if name in out or (files.weight_map and files.weight_map.get(name) != path.name):
                raise CheckpointError(
                    f"{path}: tensor {name!r} is also in another shard, or the index puts it in "
                    f"{files.weight_map.get(name)}",
                    folder=str(folder),
                )
            out[name] = tensor
    missing = sorted(set(files.weight_map) - set(out))
    if missing:
        raise CheckpointError(f"{folder / INDEX_NAME} lists tensors no shard holds: {missing[:5]}", folder=str(folder))
    if fingerprint(files.files) != before:
        raise CheckpointChangedError(f"{folder}: its weight files changed while read", folder=str(folder))
    return out
