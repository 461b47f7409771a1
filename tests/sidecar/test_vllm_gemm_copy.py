"""Which vLLM CPU linears hold a GEMM copy of their weight (``layout.holds_gemm_copy``), against behaviour.

Only a layer whose ``cpu_linear`` packed its weight once must be re-packed after a write; one that reads the
live parameter at every call must not be (re-packing it costs a failed oneDNN primitive per layer on a host
without AVX-512 BF16, and changes nothing). The rule is checked against what vLLM's own dispatch gives on this
host: after the weight's memory is overwritten, a layer holding a copy still answers with the old weight.
"""

from __future__ import annotations

import types

import pytest
import torch

from stitchboard.sidecar.engines.vllm.layout import holds_gemm_copy
from tests.sidecar.vllm_fixtures import dispatched_linear

#: SmolLM2-135M's ``gate_up_proj`` shape (N, K): the dispatch path depends on the shape and dtype.
SHAPES = [(3072, 576), (576, 576)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_rule_matches_what_vllms_dispatch_gives_on_this_host(shape: tuple[int, int]) -> None:
    layer, holds_old = dispatched_linear(shape)  # asserts the layer answers with the old or the new weight
    assert holds_gemm_copy(layer) == holds_old  # type: ignore[arg-type]


def test_closures_are_copies_and_plain_functions_read_the_live_weight() -> None:
    packed = torch.zeros(2, 2)

    def closure(x, weight, bias):  # the shape of a packed cpu_linear
        return x @ packed

    cases = {
        "closure over a packed copy": (closure, True),
        "a packed copy held as a default argument": (lambda x, weight, bias, _packed=packed: x @ _packed, True),
        "plain function of its arguments": (lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias), False),
        "torch's linear itself": (torch.nn.functional.linear, False),
        "an opaque object": ("packed elsewhere", True),
    }
    for what, (fn, holds) in cases.items():
        assert holds_gemm_copy(types.SimpleNamespace(cpu_linear=fn)) is holds, what  # type: ignore[arg-type]
    assert holds_gemm_copy(torch.nn.Linear(2, 2)) is False  # no cpu_linear: no copy


class _LoraWrapper(torch.nn.Module):
    """As vLLM's ``BaseLayerWithLoRA``: unknown attributes come from the wrapped ``base_layer``."""

    def __init__(self, base_layer: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_layer, name)


def test_a_lora_wrapper_is_not_a_second_holder_of_its_base_layers_copy() -> None:
    base = torch.nn.Linear(2, 2)
    packed = torch.zeros(2, 2)
    base.cpu_linear = lambda x, weight, bias: x @ packed  # type: ignore[assignment]
    wrapper = _LoraWrapper(base)
    assert wrapper.cpu_linear is base.cpu_linear  # the wrapper seems to have one
    assert holds_gemm_copy(base) and not holds_gemm_copy(wrapper)
