"""Run assets: the model's non-weight files, so that a pulled version is a servable folder.

A run carries ``config.json``, ``generation_config.json``, the tokenizer files and the chat
template once: they are uploaded with version 0 and never change. Every later anchor references
the same blobs (same sha256, nothing uploaded again), so the plan to any version, which loads
its nearest anchor's ``snapshot`` and ``asset`` files, always brings them along, even after
retention removed version 0.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stitchboard.proto.schema import FileRef, check_path, is_checkpoint_file

from .errors import AssetsError

#: File names taken from a model folder: what transformers and vLLM read besides the weights.
ASSET_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


@dataclass(frozen=True)
class Asset:
    """One asset file: its name in the version folder and its bytes."""

    path: str
    data: bytes

    @property
    def ref(self) -> FileRef:
        """The manifest entry (role ``asset``)."""
        return FileRef(
            path=self.path, sha256=hashlib.sha256(self.data).hexdigest(), size_bytes=len(self.data), role="asset"
        )


def load_assets(source: str | os.PathLike[str] | Mapping[str, bytes]) -> list[Asset]:
    """Read run assets from a model folder or a ``{file name: bytes}`` mapping.

    Args:
        source: a folder (the files of :data:`ASSET_NAMES` present in it are taken; weights and
            other files are ignored) or a mapping of file names to contents (taken as is).

    Returns:
        Assets sorted by name.

    Raises:
        AssetsError: the folder does not exist, holds none of :data:`ASSET_NAMES`, or a name is
            invalid or a weight file (``.safetensors``, ``.bin``, the index json).
    """
    if isinstance(source, Mapping):
        items = {str(k): bytes(v) for k, v in source.items()}
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise AssetsError(f"assets folder {folder} does not exist")
        items = {name: (folder / name).read_bytes() for name in ASSET_NAMES if (folder / name).is_file()}
        if not items:
            raise AssetsError(f"{folder} holds none of the asset files {', '.join(ASSET_NAMES[:4])}, ...")
    for name in items:
        try:
            check_path(name, "asset name")
        except Exception as exc:  # noqa: BLE001 - any refusal of the name is an assets error
            raise AssetsError(str(exc)) from None
        if is_checkpoint_file(name) or name.endswith((".bin", ".pt", ".index.json")):
            raise AssetsError(f"{name!r} looks like a weight file; assets are the non-weight files")
    return [Asset(name, items[name]) for name in sorted(items)]


def check_same_assets(published: list[FileRef], given: list[Asset]) -> None:
    """Check that assets given to a resumed publisher equal those the run already carries.

    Raises:
        AssetsError: naming the files that differ, are new or are missing.
    """
    have = {f.path: f.sha256 for f in published}
    want = {a.path: a.ref.sha256 for a in given}
    if have != want:
        differ = sorted(p for p in set(have) | set(want) if have.get(p) != want.get(p))
        raise AssetsError(f"run assets are immutable (published with version 0); these differ: {differ}", files=differ)
