"""The served view: what a rollout engine serves, computed from a trainer's model or state dict.

A trainer keeps float32 master weights; an engine serves what it loads from a checkpoint,
usually their bf16 cast. :func:`served_view` makes that cast (``Tensor.to(torch.bfloat16)``,
round-to-nearest-even, the same rounding ``save_pretrained`` of a bf16 model applies) for every
floating tensor, or the dtype a per-tensor map names, and returns host copies as
:class:`~stitchboard.proto.container.RawTensor` (raw bits, zero-copy views of the host tensors).

Checkpoint names (DESIGN.md invariant 10) are the names an HF loader expects:

* wrapper prefixes are removed: a leading ``module.`` (DDP, DataParallel), and every
  ``_orig_mod.`` (torch.compile), ``_fsdp_wrapped_module.`` (FSDP1) and
  ``_checkpoint_wrapped_module.`` (activation checkpointing) segment;
* tied weights (several names over one storage, e.g. ``lm_head.weight`` tied to
  ``model.embed_tokens.weight``) are published once. The name kept is the first one that the
  model's ``_tied_weights_keys`` does not list (HF models list the alias their
  ``save_pretrained`` drops, ``lm_head.weight``); without that attribute, the first name in
  ``state_dict`` order, which for HF models is the input embedding. So a tied SmolLM2 or Llama
  publishes ``model.embed_tokens.weight`` only, exactly as its checkpoint holds it. A copied
  state dict holds the head as a tensor of its own: when the model's config ties the embeddings
  it is folded into the embedding if bitwise equal, and refused otherwise (:mod:`.tied_head`).

A transformers model that fuses tensors when it loads (transformers 5 MoE experts:
``mlp.experts.gate_up_proj`` [E, 2I, H]) publishes them under its checkpoint's names, split
per expert as ``save_pretrained`` writes them (``...experts.E.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.E.w1.weight``), through transformers' own reverse conversion.

Only ``state_dict`` entries are published: persistent parameters and buffers, not the
non-persistent buffers (e.g. rotary ``inv_freq``) that a loader recomputes.

Quantized served views (FP8, NVFP4) are made from this bf16 view by the recipes of
:mod:`.recipes` (``Publisher(served=...)``); a per-tensor cast to an fp8 dtype is not one of
them (no scales) and the publishers refuse it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import numpy as np
import torch

from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import bits_type

from .errors import CheckpointNameError, ServedViewError
from .tied_head import fold_tied_head, ties_of_module

#: torch dtype -> safetensors dtype name (the codec's dtype names, see proto/dtypes.py).
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPE_NAMES[torch.float8_e8m0fnu] = "F8_E8M0"
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        TORCH_DTYPE_NAMES[getattr(torch, _name)] = _code

#: Unsigned torch dtype of each element size, to reinterpret bits without a copy.
_BITS_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Segments that wrappers insert into parameter names; removed wherever they appear.
WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

#: A per-tensor dtype map: checkpoint name or fnmatch pattern -> dtype of the served tensor.
DtypeMap = Mapping[str, torch.dtype]

#: Where a tensor's elements lie: (device, storage address, offset, shape, strides, dtype); equal keys, one tensor.
StorageKey = tuple[torch.device, int, int | torch.SymInt, tuple[int, ...], tuple[int, ...], torch.dtype]


def checkpoint_name(name: str) -> str:
    """The checkpoint name of a (possibly wrapped) parameter name.

    ``module._orig_mod.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``.
    """
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _storage_key(t: torch.Tensor) -> StorageKey | None:
    if getattr(t, "is_sparse", False) or t.numel() == 0:
        return None
    local = t.to_local() if hasattr(t, "to_local") else t
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
    )


def _reverted_hf_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the checkpoint names of a transformers model that fuses tensors at load.

    transformers 5 holds MoE experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) and
    renames some modules (Mixtral's ``block_sparse_moe``); its ``save_pretrained`` reverts that
    (``revert_weight_conversion``) and so does this, giving per-expert tensors (copies) under
    the names the checkpoint holds. Models whose names do not change (dense Llama/Qwen) keep
    ``state`` as it is (the live tensors).
    """
    if not any(t.ndim == 3 for t in state.values()):  # fused experts are [E, rows, cols]
        return state
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    if not isinstance(module, PreTrainedModel):
        return state
    with torch.no_grad():
        reverted = revert_weight_conversion(module, {k: v.detach() for k, v in state.items()})
    return state if set(reverted) == set(state) else dict(reverted)


def checkpoint_state(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], tied: bool | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor of a model (its ``state_dict``) or a state dict.

    Wrapper segments are stripped and tied tensors kept once (see the module docstring). The
    tensors are the live ones (no copy); values may be ``DTensor`` s (FSDP2/TP; comparing a
    head with its embedding gathers both, a collective every rank makes).

    Args:
        model_or_state_dict: the model or a state dict.
        tied: whether the model's config ties its embeddings (``tie_word_embeddings``); None:
            the transformers model's own config when a model is given, else unknown (no fold).

    Raises:
        CheckpointNameError: two different tensors map to the same checkpoint name.
        TiedWeightsError: the config ties the embeddings but the head and the embedding differ.
        ServedViewError: a value is not a ``torch.Tensor``.
    """
    if isinstance(model_or_state_dict, torch.nn.Module) and tied is None:
        tied = ties_of_module(getattr(model_or_state_dict, "module", model_or_state_dict))
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict(keep_vars=True)
        module = model_or_state_dict
        while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
            module = module.module  # DDP/DataParallel hold the model as .module
        module = getattr(module, "_orig_mod", module)
        tied_keys = getattr(module, "_tied_weights_keys", None) or ()
        dropped = {checkpoint_name(k) for k in tied_keys} if not isinstance(tied_keys, str) else {tied_keys}
        state = _reverted_hf_state(module, state)
    else:
        state, dropped = dict(model_or_state_dict), set()
    groups: dict[StorageKey, list[str]] = {}
    out: dict[str, torch.Tensor] = {}
    for raw_name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ServedViewError(f"state entry {raw_name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        name = checkpoint_name(raw_name)
        if name in out:
            if _storage_key(out[name]) == _storage_key(tensor) and _storage_key(tensor) is not None:
                continue
            raise CheckpointNameError(
                f"{raw_name!r} and another tensor both map to checkpoint name {name!r}", name=name
            )
        key = _storage_key(tensor)
        if key is not None:
            groups.setdefault(key, []).append(name)
        out[name] = tensor.detach()
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in dropped), names[0])
            for n in names:
                if n != keep:
                    del out[n]
    return fold_tied_head(out, tied, _same_torch_bits)


def _same_torch_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (DTensors gathered) have the same dtype, shape and bits."""
    a, b = gather_full(a), gather_full(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS_TORCH[a.element_size()]
    with torch.no_grad():
        return bool(torch.equal(a.detach().contiguous().view(bits), b.detach().to(a.device).contiguous().view(bits)))


def served_dtype(name: str, tensor: torch.Tensor, dtypes: DtypeMap | None, default: torch.dtype) -> torch.dtype:
    """The dtype ``name`` is served in: the map's exact entry, else its first matching pattern,
    else ``default`` for floating tensors and the tensor's own dtype for the rest."""
    if dtypes:
        if name in dtypes:
            return dtypes[name]
        for pattern, dtype in dtypes.items():
            if fnmatch.fnmatchcase(name, pattern):
                return dtype
    return default if tensor.is_floating_point() else tensor.dtype


def to_raw(t: torch.Tensor) -> RawTensor:
    """A contiguous CPU tensor as a :class:`RawTensor` sharing its memory (no copy).

    Raises:
        ServedViewError: the dtype has no safetensors name, or ``t`` is not a contiguous CPU tensor.
    """
    dtype = TORCH_DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise ServedViewError(
            f"dtype {t.dtype} has no safetensors name; serve it as one of {sorted(map(str, TORCH_DTYPE_NAMES))}"
        )
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ServedViewError("to_raw needs a contiguous CPU tensor")
    flat = t.reshape(-1)
    bits = flat.view(_BITS_TORCH[t.element_size()]).numpy().view(bits_type(dtype))
    return RawTensor(dtype, tuple(t.shape), bits)


def from_raw(raw: RawTensor) -> torch.Tensor:
    """A torch tensor over a :class:`RawTensor`'s bits (shares memory when they are writable)."""
    name_to_torch = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
    bits = raw.bits if raw.bits.flags.writeable else raw.bits.copy()
    signed = bits.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[bits.itemsize])
    return torch.from_numpy(signed).view(name_to_torch[raw.dtype]).reshape(raw.shape)


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` (a collective: every rank of its mesh must call it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cast_served(
    name: str, t: torch.Tensor, dtypes: DtypeMap | None = None, default: torch.dtype = torch.bfloat16
) -> RawTensor:
    """A host copy of one tensor in its served dtype, as raw bits (always a fresh copy)."""
    target = served_dtype(name, t, dtypes, default)
    with torch.no_grad():
        host = t.detach().to(dtype=target, device="cpu", copy=True).contiguous()
    return to_raw(host)


def cast_served_where_it_lives(
    name: str, t: torch.Tensor, dtypes: DtypeMap | None = None, default: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """:func:`cast_served` made on ``t``'s own device (a GPU: the device diff path, :mod:`.device_diff`).

    Returns:
        A fresh contiguous tensor in the served dtype on ``t``'s device (never ``t`` itself, even when it already has
        that dtype: the publisher may keep it while the trainer writes ``t``); the same bits as :func:`cast_served`
        (``Tensor.to``: round-to-nearest-even on every device).

    Raises:
        ServedViewError: the served dtype has no safetensors name.
    """
    target = served_dtype(name, t, dtypes, default)
    if target not in TORCH_DTYPE_NAMES:
        raise ServedViewError(
            f"dtype {target} has no safetensors name; serve it as one of {sorted(map(str, TORCH_DTYPE_NAMES))}"
        )
    with torch.no_grad():
        return t.detach().to(dtype=target, copy=True).contiguous()


def served_view(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    dtypes: DtypeMap | None = None,
    default: torch.dtype = torch.bfloat16,
    tied: bool | None = None,
) -> dict[str, RawTensor]:
    """Snapshot the served view: checkpoint name -> host copy in the served dtype, as raw bits.

    Args:
        model_or_state_dict: the trainer's model or state dict (CPU or GPU tensors, DTensors
            gathered with :func:`gather_full`, which is collective on a multi-rank mesh).
        dtypes: per-tensor served dtype, by checkpoint name or fnmatch pattern.
        default: served dtype of floating tensors the map does not name (bf16).
        tied: whether the model's config ties its embeddings (see :func:`checkpoint_state`).

    Returns:
        A fresh dict (not sharing memory with the model) of :class:`RawTensor`, names sorted.
        Costs one host copy of the view: 2 bytes per element for bf16.

    Raises:
        CheckpointNameError, ServedViewError: see :func:`checkpoint_state` and :func:`to_raw`.
    """
    state = checkpoint_state(model_or_state_dict, tied)
    return {name: cast_served(name, gather_full(state[name]), dtypes, default) for name in sorted(state)}
