"""Adapter runs on the trainer side: a PEFT LoRA model published as its adapter's served view (issue #31).

``Publisher.publish(peft_model)`` publishes the adapter weights only: PEFT's own
``get_peft_model_state_dict`` (the names ``adapter_model.safetensors`` holds, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), cast to the served dtype (bf16)
like any view, with the :class:`~stitchboard.proto.adapter.AdapterSpec` in every manifest. The
spec's ``base_checksum`` is :func:`~stitchboard.proto.adapter.view_checksum` over the base model's
served view as a full run of it would publish it (:func:`base_view_checksums`), computed once per
publisher (the base is frozen in a LoRA run) and cached.

Refused at publish, before anything is uploaded, with :class:`AdapterRefusedError` naming the field:
a PEFT model without a config for its active adapter (``peft_config``), a non-LoRA type
(``peft_type``), ``target_modules`` given as a pattern, the options of
:data:`~stitchboard.proto.adapter.UNSUPPORTED_CONFIG` (``use_dora``, ``modules_to_save``,
``trainable_token_indices``, ...), a non-empty ``rank_pattern``/``alpha_pattern``, a tensor that is
not a LoRA factor (an added token's embedding saved beside the adapter), a served recipe other than
bf16, a change of a fixed field (rank, alpha, target modules, base...) between this publisher's
versions, and a full model published to an adapter run or the other way round (``adapter``).

No ``peft`` import: a model is a PEFT model only when ``peft`` is imported already (it made the
model). Runs in the trainer process.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from stitchboard.proto.adapter import UNSUPPORTED_CONFIG, AdapterSpec, spec_mismatch, view_checksum
from stitchboard.proto.codec import checksum

from .errors import AdapterRefusedError
from .served_view import DtypeMap, cast_served, checkpoint_state, gather_full


def peft_model_of(model_or_state_dict: object) -> torch.nn.Module | None:
    """The ``peft.PeftModel`` given (or held as ``.module`` by DDP), else None (also when peft is not imported)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    for candidate in (model_or_state_dict, getattr(model_or_state_dict, "module", None)):
        if isinstance(candidate, peft.PeftModel):
            return cast(torch.nn.Module, candidate)
    return None


def _json_safe(value: Any) -> Any:
    """A PEFT config value as plain JSON: sets as sorted lists, str enums as their value, tuples as lists."""
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return _json_safe(value.value)  # PeftType, TaskType
    return value


def _refuse(field: str, value: Any, why: str) -> AdapterRefusedError:
    return AdapterRefusedError(f"adapter run: {field} = {value!r}: {why}", field=field, value=_json_safe(value))


def adapter_config(peft_model: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's ``adapter_config.json`` as PEFT's ``save_pretrained`` writes it (``inference_mode``
    true), JSON-safe, checked for what an adapter run serves.

    Raises:
        AdapterRefusedError: no config, not LoRA, a pattern for ``target_modules``, no base model name, an option of
            ``UNSUPPORTED_CONFIG``, or a non-empty ``rank_pattern``/``alpha_pattern``; ``details["field"]`` names it.
    """
    name = getattr(peft_model, "active_adapter", "default")
    config = getattr(peft_model, "peft_config", {}).get(name)
    if config is None:
        raise _refuse("peft_config", None, f"the PEFT model has no config for its active adapter {name!r}")
    out: dict[str, Any] = _json_safe(config.to_dict())
    out["inference_mode"] = True
    if not out.get("base_model_name_or_path"):  # as PeftModel.save_pretrained fills it: the base's name_or_path
        out["base_model_name_or_path"] = peft_model.get_base_model().__dict__.get("name_or_path") or None  # type: ignore[operator]
    if out.get("peft_type") != "LORA":
        raise _refuse("peft_type", out.get("peft_type"), "only LoRA adapters are served; train with a LoraConfig")
    if not isinstance(out.get("target_modules"), list):
        raise _refuse("target_modules", out.get("target_modules"), "name the modules as a list, not a pattern")
    if not out.get("base_model_name_or_path"):
        raise _refuse("base_model_name_or_path", None, "the base model is unnamed; load it with from_pretrained(id)")
    for key, why in UNSUPPORTED_CONFIG.items():
        if out.get(key):
            raise _refuse(key, out[key], why)
    for key in ("rank_pattern", "alpha_pattern"):
        if out.get(key):
            raise _refuse(key, out[key], "per-module ranks or alphas are not served yet; use one r and lora_alpha")
    return out


def adapter_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under the names ``adapter_model.safetensors`` holds (PEFT's own
    ``get_peft_model_state_dict``; live tensors, no copy; float32 masters for a trained adapter).

    Embedding layers are never saved beside the adapter (a resized vocabulary, i.e. added tokens, changes the
    base's served view, so its ``base_checksum`` no longer matches an engine's base).

    Raises:
        AdapterRefusedError: a tensor that is not a LoRA factor (``lora_A``/``lora_B``), e.g. an embedding PEFT
            saves for added tokens; ``details["field"]`` is ``tensors``.
    """
    from peft.utils import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = get_peft_model_state_dict(  # no embedding layers: "auto" asks the Hub each call
        peft_model, adapter_name=getattr(peft_model, "active_adapter", "default"), save_embedding_layers=False
    )
    other = sorted(n for n in state if ".lora_A." not in n and ".lora_B." not in n)
    if other:
        raise _refuse("tensors", other[:3], "only LoRA factors are served (added tokens or saved embeddings are not)")
    return state


def base_view_checksums(
    peft_model: torch.nn.Module, dtypes: DtypeMap | None = None, default: torch.dtype = torch.bfloat16
) -> dict[str, str]:
    """Checkpoint name -> xxh3-128 of each tensor of the base model's served view, one tensor cast at a time.

    The names and bits a full run of the base would publish: the unwrapped base's checkpoint state (the tied head
    folded, wrapper segments stripped) without the LoRA factors, ``.base_layer.`` removed from the wrapped layers'
    names, each tensor cast to its served dtype.
    """
    base = peft_model.get_base_model()  # type: ignore[operator]
    state = checkpoint_state(base)
    sums: dict[str, str] = {}
    for raw_name in sorted(state):
        if any(part.startswith("lora_") for part in raw_name.split(".")):
            continue
        name = raw_name.replace(".base_layer.", ".")
        sums[name] = checksum(cast_served(name, gather_full(state[raw_name]), dtypes, default))
    return sums


class AdapterRun:
    """One publisher's side of the adapter run rule: what each published model is, and the run's spec.

    Args:
        served: the publisher's served recipe name (adapter runs publish ``bf16`` only).
        dtypes, default: the publisher's served dtypes (the base view checksum uses them as a full run would).
        run_spec: called once, at the first :meth:`take`: whether the run already has a version (a resumed
            publisher) and that version's adapter (None: a full run); the run's kind and spec are taken from it.
    """

    def __init__(
        self,
        served: str,
        dtypes: DtypeMap | None,
        default: torch.dtype,
        run_spec: Callable[[], tuple[bool, AdapterSpec | None]],
    ) -> None:
        self.served, self.dtypes, self.default = served, dtypes, default
        #: The run's spec once a PEFT model was published or resumed (every manifest of the run carries it).
        self.spec: AdapterSpec | None = None
        #: Whether the run is a full run (None: not known yet).
        self._full: bool | None = None
        self._run_spec: Callable[[], tuple[bool, AdapterSpec | None]] | None = run_spec
        self._base_checksum: tuple[int, str] | None = None  # (id of the base model, its checksum)

    def take(
        self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]
    ) -> torch.nn.Module | Mapping[str, torch.Tensor]:
        """What to publish for ``model_or_state_dict``: a PEFT model's adapter state dict (its spec recorded as the
        run's), anything else unchanged.

        Raises:
            AdapterRefusedError: see the module docstring; nothing is recorded then.
        """
        if self._run_spec is not None:  # a resumed run's kind and spec, read once
            has_versions, prior = self._run_spec()
            self._run_spec = None
            self.spec, self._full = prior, (has_versions and prior is None) or None
        peft_model = peft_model_of(model_or_state_dict)
        if peft_model is None:
            if self.spec is not None:
                raise _refuse("adapter", "full", "this publisher publishes an adapter run; publish the PeftModel")
            self._full = True
            return model_or_state_dict
        if self._full:
            raise _refuse("adapter", "adapter", "this publisher publishes a full run; publish adapters to a new run")
        if self.served != "bf16":
            raise _refuse(
                "served",
                self.served,
                "adapter runs are served bf16 over a bf16 base: an FP8 or NVFP4 base under a bf16 adapter is not "
                "served (vLLM's LoRA layers over quantized linear layers are not verified here, and the base checksum "
                "names the bf16 view); publish with served='bf16'",
            )
        config = adapter_config(peft_model)
        spec = AdapterSpec(
            base_model=config["base_model_name_or_path"],
            base_checksum=self.base_checksum(peft_model),
            r=config["r"],
            lora_alpha=config["lora_alpha"],
            target_modules=sorted(set(config["target_modules"])),
            use_rslora=bool(config.get("use_rslora")),
            config=config,
        )
        state = adapter_state(peft_model)
        if self.spec is not None:
            changed = spec_mismatch(self.spec, spec)
            if changed is not None:
                field, old, new = changed
                raise AdapterRefusedError(
                    f"adapter run: {field} changed from {old!r} to {new!r} between versions; "
                    "an adapter run keeps it: publish the new adapter to a new run",
                    field=field,
                    value=_json_safe(new),
                    previous=_json_safe(old),
                )
        else:
            self.spec = spec
        return state

    def base_checksum(self, peft_model: torch.nn.Module) -> str:
        """:func:`view_checksum` of the base's served view, computed once per base model object."""
        base = peft_model.get_base_model()  # type: ignore[operator]
        if self._base_checksum is None or self._base_checksum[0] != id(base):
            self._base_checksum = (id(base), view_checksum(base_view_checksums(peft_model, self.dtypes, self.default)))
        return self._base_checksum[1]
