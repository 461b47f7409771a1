"""Adapter runs on the wire: the LoRA adapter a run's versions hold, its served names, the base's checksum.

An adapter run is a run whose versions are a PEFT LoRA adapter over a fixed base model instead
of a whole model (issue #31). Its manifests carry an :class:`AdapterSpec` (``VersionManifest.adapter``,
defined in :mod:`.adapter_spec` and re-exported here); their tensors are the adapter's served view
under PEFT's saved names (as in ``adapter_model.safetensors``, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), in the served dtype
(``served="bf16"``). Versions are deltas and anchors like any run's.

The base model is named by its served name and fixed by :func:`view_checksum` over the base's
served view, so a sidecar beside another base refuses the run. A version of an adapter run is
served under :func:`adapter_name` (``<run>@<version>``).

No server, engine or PEFT imports: every process reads this (docs/adapters.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import xxhash

from .adapter_spec import FIXED_FIELDS, UNSUPPORTED_CONFIG, AdapterSpec, spec_mismatch, unsupported_config
from .errors import SchemaError
from .schema import check_run_id

__all__ = [
    "FIXED_FIELDS",
    "UNSUPPORTED_CONFIG",
    "AdapterSpec",
    "adapter_name",
    "parse_adapter_name",
    "spec_mismatch",
    "unsupported_config",
    "view_checksum",
]


def view_checksum(checksums: Mapping[str, str]) -> str:
    """The checksum of a whole served view: xxh3-128 hex of its per-tensor checksums, in name order.

    Args:
        checksums: tensor (checkpoint) name -> that tensor's ``xxh3_128`` hex digest (as manifests
            carry it).

    Returns:
        32 lowercase hex digits: xxh3-128 of the UTF-8 of ``"".join(f"{name}\\t{checksum}\\n" ...)``
        over the names sorted by code point.

    Raises:
        SchemaError: a name holds a tab or newline (the joined text would be ambiguous), or the view is empty.
    """
    if not checksums:
        raise SchemaError("view_checksum of an empty view: a base model has at least one tensor")
    hasher = xxhash.xxh3_128()
    for name in sorted(checksums):
        if "\t" in name or "\n" in name:
            raise SchemaError(f"tensor name {name!r} holds a tab or newline: it cannot be part of a view checksum")
        hasher.update(f"{name}\t{checksums[name]}\n".encode())
    return str(hasher.hexdigest())


def spec_json(spec: AdapterSpec) -> bytes:
    """``adapter_config.json``'s bytes for a spec, as PEFT writes them (2-space indent, sorted keys)."""
    return json.dumps(spec.config, indent=2, sort_keys=True).encode()


def adapter_name(run_id: str, version: int) -> str:
    """The served name of a version of an adapter run: ``<run>@<version>`` (e.g. ``grpo-lora@12``).

    Raises:
        SchemaError: a bad run id or a negative version.
    """
    check_run_id(run_id)
    if version < 0:
        raise SchemaError(f"adapter version {version} of run {run_id!r} is negative")
    return f"{run_id}@{version}"


def parse_adapter_name(name: str) -> tuple[str, int | None]:
    """Split a requested model name into ``(run, version)``: ``"r@3"`` -> ``("r", 3)``, ``"r"`` -> ``("r", None)``.

    Raises:
        SchemaError: the run part is not a run id, or the version part is not a decimal integer >= 0.
    """
    run, sep, tail = name.partition("@")
    check_run_id(run)
    if not sep:
        return run, None
    if not tail.isascii() or not tail.isdigit() or len(tail) > 16:
        raise SchemaError(f"adapter name {name!r}: the part after '@' must be a version number, e.g. {run}@3")
    return run, int(tail)
