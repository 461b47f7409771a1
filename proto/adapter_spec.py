"""The adapter a LoRA run's versions hold (:class:`AdapterSpec`) and what two versions must agree on.

An adapter run's manifests carry an :class:`AdapterSpec` (``VersionManifest.adapter``); the
names and checksums of adapter runs are in :mod:`.adapter`, which re-exports everything here
(import from there). This module imports nothing of the package, so :mod:`.schema` can hold the
spec in a manifest. Every version of a run has the same spec in everything but PEFT's free
bookkeeping (:data:`FIXED_FIELDS`; :func:`spec_mismatch`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The fields two versions of one adapter run must agree on, in the order they are compared
#: (``config.<key>`` is a key of the PEFT config): a change is a new run.
FIXED_FIELDS = (
    "base_model",
    "base_checksum",
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "config.rank_pattern",
    "config.alpha_pattern",
)

#: PEFT config keys whose set value adds tensors or math a LoRA adapter's served view cannot carry
#: (an engine's LoRA loader would load something else): the key -> what to do instead.
UNSUPPORTED_CONFIG = {
    "use_dora": "DoRA adds a magnitude vector engines load differently; train plain LoRA (use_dora=False)",
    "modules_to_save": "whole modules trained beside the adapter are not adapter weights; leave modules_to_save empty",
    "trainable_token_indices": "trainable tokens change the base's embedding; leave trainable_token_indices unset",
    "use_qalora": "QA-LoRA pools the input differently; set use_qalora=False",
    "lora_bias": "a LoRA bias is an extra tensor engines do not load; set lora_bias=False",
    "layer_replication": "replicated layers change the base model; leave layer_replication unset",
}


def unsupported_config(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The keys of a PEFT config (``LoraConfig.to_dict()``-shaped) set to something an adapter run refuses.

    A key counts as set when its value is truthy (``True``, a non-empty list or dict). Keys are
    those of :data:`UNSUPPORTED_CONFIG`, in that order, with their values.
    """
    return [(key, config[key]) for key in UNSUPPORTED_CONFIG if config.get(key)]


class AdapterSpec(BaseModel):
    """What an adapter run's versions are: a LoRA adapter over one base model.

    Attributes:
        base_model: the base model's served name / HF id (what a request names for the base).
        base_checksum: :func:`view_checksum` over every tensor of the base's served view
            (checkpoint names, the names and bits a full-run anchor of that base would hold): see
            ``stitchboard.proto.adapter.view_checksum``.
        peft_type: ``LORA`` (the only kind served).
        r: the LoRA rank (>= 1).
        lora_alpha: the LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rslora).
        target_modules: the module names the adapter wraps, sorted, unique.
        use_rslora: rank-stabilized scaling.
        config: the ``adapter_config.json`` an engine or PEFT loads (PEFT's ``LoraConfig.to_dict()``,
            JSON-safe, ``base_model_name_or_path`` set to ``base_model``); must agree with the fields
            above and set none of :data:`UNSUPPORTED_CONFIG`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_model: Annotated[str, Field(min_length=1, max_length=512)]
    base_checksum: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    peft_type: Literal["LORA"] = "LORA"
    r: Annotated[int, Field(ge=1)]
    lora_alpha: float
    target_modules: list[str]
    use_rslora: bool = False
    config: dict[str, Any]

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v or any(not m for m in v):
            raise ValueError("target_modules must name at least one module, each non-empty")
        if v != sorted(set(v)):
            raise ValueError(f"target_modules must be sorted and unique, got {v[:8]}")
        return v

    @model_validator(mode="after")
    def _agrees(self) -> AdapterSpec:
        try:
            json.dumps(self.config, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config is not plain JSON: {exc}") from None
        cfg = self.config
        want = {
            "peft_type": self.peft_type,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "base_model_name_or_path": self.base_model,
        }
        for key, value in want.items():
            if cfg.get(key) != value:
                raise ValueError(f"config[{key!r}] is {cfg.get(key)!r} but the spec says {value!r}")
        targets = cfg.get("target_modules")
        if not isinstance(targets, list) or sorted(set(map(str, targets))) != self.target_modules:
            raise ValueError(f"config['target_modules'] is {targets!r} but the spec says {self.target_modules}")
        bad = unsupported_config(cfg)
        if bad:
            key, value = bad[0]
            raise ValueError(f"config[{key!r}] = {value!r} is not served: {UNSUPPORTED_CONFIG[key]}")
        return self

    def field(self, name: str) -> Any:
        """The value of one of :data:`FIXED_FIELDS` (``config.<key>``: that config key, ``None`` if absent)."""
        if name.startswith("config."):
            return self.config.get(name.removeprefix("config."))
        return getattr(self, name)


def spec_mismatch(base: AdapterSpec | None, new: AdapterSpec | None) -> tuple[str, Any, Any] | None:
    """The first field in which a version's adapter differs from its base version's, or ``None``.

    Returns ``(field, base_value, new_value)``; the field is ``adapter`` when one is an adapter
    run's version and the other a full run's (values ``"adapter"``/``"full"``), else one of
    :data:`FIXED_FIELDS`. A free config key (dropout, ``peft_version``, ...) may change.
    """
    if (base is None) != (new is None):
        return ("adapter", "full" if base is None else "adapter", "full" if new is None else "adapter")
    if base is None or new is None:
        return None
    for name in FIXED_FIELDS:
        old, now = base.field(name), new.field(name)
        if old != now and not (name.startswith("config.") and not old and not now):
            return (name, old, now)
    return None
