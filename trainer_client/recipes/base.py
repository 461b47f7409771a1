"""What every served-view recipe shares: which tensors a format quantizes, and the bf16 recipe.

A recipe turns the bf16 served view (:func:`~stitchboard.trainer_client.served_view.served_view`,
checkpoint name -> :class:`RawTensor`) into the tensors an engine loads for one weight format,
and says what ``config.json`` must carry for that format (``quantization_config``).

Input: the **bf16 cast** of the master weights, not the fp32 masters. Reasons: (1) it is what
every quantizer of a released model starts from (the bf16 checkpoint), so an anchor of a
quantized view equals that quantizer's output on the bf16 anchor and can be rebuilt from a
pulled bf16 version; (2) it does not depend on how the trainer keeps its masters (fp32, bf16,
mixed); (3) a quantized code can then only change where the bf16 value or its group's scale
changed, so the patch measures what the coarser format absorbs of the bf16 changes. The cost, a
double rounding (fp32 -> bf16 -> fp8/fp4), moves a value by at most half a bf16 ulp
(2**-9 relative), 8x finer than an e4m3 step.

Quantized tensors (:func:`is_quantized`): 2-D floating ``*.weight`` of the linear layers inside
decoder layers (``model.layers.N.``): attention and MLP projections, experts. Kept as they are
(bf16), as the engines' loaders of these formats expect: embeddings, ``lm_head``, norms, biases,
and MoE routers (modules named ``gate``, ``router``, ``shared_expert_gate``).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from stitchboard.proto.container import RawTensor

from ..assets import Asset
from ..errors import ServedViewError
from ..served_view import from_raw, to_raw

#: Decoder-layer tensors (``...layers.12.``): only these are quantized.
_IN_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
#: Leaf modules kept in high precision inside decoder layers: MoE routers.
ROUTER_MODULES = ("gate", "router", "shared_expert_gate")
#: ``ignore`` entries of a compressed-tensors config: the modules the recipes keep in bf16 that
#: vLLM would otherwise treat as quantized linears (``lm_head``, routers).
CT_IGNORE = ["lm_head", "re:.*\\.(gate|router|shared_expert_gate)$"]


def module_of(name: str) -> str:
    """The module of a parameter name: ``a.b.q_proj.weight`` -> ``a.b.q_proj``."""
    return name.rsplit(".", 1)[0]


def is_quantized(name: str, t: RawTensor) -> bool:
    """Whether a recipe other than bf16 quantizes tensor ``name`` (see the module docstring)."""
    return quantizes(name, t.dtype, tuple(t.shape))


def quantizes(name: str, dtype: str, shape: tuple[int, ...]) -> bool:
    """:func:`is_quantized` of a tensor given by its safetensors dtype name and shape."""
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in ("BF16", "F16", "F32"):
        return False
    leaf = module_of(name).rsplit(".", 1)[-1]
    return _IN_LAYER.search(name) is not None and "norm" not in leaf and leaf not in ROUTER_MODULES


def as_float(t: RawTensor) -> torch.Tensor:
    """A floating raw tensor (bf16, f16, f32, e4m3 codes) as a float32 torch tensor (exact upcast, a copy)."""
    return from_raw(t).to(torch.float32)


def raw(t: torch.Tensor) -> RawTensor:
    """A CPU torch tensor as a :class:`RawTensor` (made contiguous; shares memory when it was)."""
    return to_raw(t.contiguous())


class ServedRecipe(ABC):
    """A named, deterministic map from the bf16 served view to one weight format's view.

    Subclasses set :attr:`name` and implement :meth:`quantize` (one weight) and
    :meth:`dequantize`; :meth:`apply` maps a whole view.
    """

    #: The recipe's name (``Publisher(served=...)``, the manifest's ``served`` field).
    name: ClassVar[str]
    #: Suffixes of the tensors that replace one quantized ``X.weight`` (``X`` + suffix).
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: Whether :meth:`quantize` needs only the weight itself (then a publish streams the view tensor by tensor,
    #: :mod:`..stream`); False: it reads other tensors of the view (NVFP4's fused groups share a global scale).
    per_tensor: ClassVar[bool] = True
    #: Whether :meth:`apply_tensor` runs the recipe on a torch tensor where it lives (a GPU: the device diff path,
    #: :mod:`..device_diff`); False: the served tensor is quantized on the host.
    on_device: ClassVar[bool] = False

    def apply(self, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """The served view of this format: every quantized weight replaced by its tensors.

        Args:
            view: the bf16 served view, checkpoint name -> raw tensor.

        Returns:
            A new dict, names sorted; tensors not quantized are the same objects as in ``view``.

        Raises:
            ServedViewError: a quantized weight does not fit the format (e.g. NVFP4 needs a
                column count divisible by 16), naming it.
        """
        out: dict[str, RawTensor] = {}
        for name, t in view.items():
            if is_quantized(name, t):
                out.update(self.quantize(name, t, view))
            else:
                out[name] = t
        return dict(sorted(out.items()))

    def apply_tensor(self, name: str, t: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """One tensor of the bf16 served view as this format's tensors, computed where ``t`` lives (a recipe with
        :attr:`on_device`): the same bits as :meth:`apply` gives for its host copy.

        Args:
            name: checkpoint name; t: the served (bf16) tensor on its device; dtype: its safetensors dtype name.

        Returns:
            Name -> tensor on ``t``'s device (``t`` itself when not quantized).
        """
        if not quantizes(name, dtype, tuple(t.shape)):
            return {name: t}
        return self.quantize_tensor(name, t)

    def quantize_tensor(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors replacing weight ``name`` (bf16 [N, K] torch tensor, any device) for a recipe with
        :attr:`on_device`.

        Raises:
            ServedViewError: this recipe has no per-tensor torch form (it reads other tensors of the view).
        """
        raise ServedViewError(f"the {self.name!r} recipe quantizes on the host only (weight {name!r})")

    @abstractmethod
    def quantize(self, name: str, t: RawTensor, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """The served tensors replacing weight ``name`` (``view``: the whole bf16 view, for fused groups)."""

    @abstractmethod
    def dequantize(self, view: Mapping[str, RawTensor], module: str) -> torch.Tensor:
        """float32 [N, K] weight of ``module`` reconstructed from this format's served tensors."""

    @abstractmethod
    def quantization_config(self) -> dict[str, Any] | None:
        """The ``quantization_config`` of ``config.json`` for this format (None: none)."""

    def config_json(self, data: bytes) -> bytes:
        """``config.json`` bytes with this format's ``quantization_config`` set (unchanged for bf16).

        Raises:
            ServedViewError: ``data`` is not a JSON object, or it already names another quantization.
        """
        qc = self.quantization_config()
        if qc is None:
            return data
        try:
            config = json.loads(data)
        except ValueError as exc:
            raise ServedViewError(
                f"config.json is not JSON ({exc}); the {self.name!r} view needs a config it can add "
                "quantization_config to"
            ) from None
        if not isinstance(config, dict):
            raise ServedViewError("config.json is not a JSON object")
        if config.get("quantization_config") not in (None, qc):
            raise ServedViewError(
                f"config.json already has a quantization_config; the {self.name!r} recipe starts from an "
                "unquantized model's config"
            )
        config["quantization_config"] = qc
        return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()

    def asset(self, asset: Asset) -> Asset:
        """A run asset as this format's checkpoint needs it: ``config.json`` via :meth:`config_json`, the rest as is."""
        return Asset(asset.path, self.config_json(asset.data)) if asset.path == "config.json" else asset


class Bf16Recipe(ServedRecipe):
    """``bf16``: the served view as the bf16 cast gives it (the default; no quantization)."""

    name = "bf16"
    on_device = True

    def apply(self, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """``view`` itself, names sorted."""
        return dict(sorted(view.items()))

    def apply_tensor(self, name: str, t: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        """``{name: t}``: nothing is quantized."""
        return {name: t}

    def quantize(self, name: str, t: RawTensor, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """``{name: t}``."""
        return {name: t}

    def dequantize(self, view: Mapping[str, RawTensor], module: str) -> torch.Tensor:
        """The module's weight as float32."""
        return as_float(view[f"{module}.weight"])

    def quantization_config(self) -> dict[str, Any] | None:
        """None: a bf16 checkpoint has no quantization_config."""
        return None
