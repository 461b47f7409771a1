"""Adapter runs (issue #31): a real PEFT LoRA model on a tiny Llama trained with AdamW, published with the same
``Publisher.publish`` to a real bulletin on loopback; every version pulled as a PEFT folder bit for bit against
PEFT's own state dict and loaded back by ``PeftModel.from_pretrained``; the plan, squash and gc of an adapter run;
each refusal at publish (the SDK) and at commit (the bulletin's 409)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoHaConfig, LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from stitchboard.bulletin.errors import AdapterMismatchError
from stitchboard.bulletin.ledger import Ledger
from stitchboard.bulletin.retention import collect_garbage
from stitchboard.bulletin.stores import open_store
from stitchboard.proto.adapter import view_checksum
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.trainer_client.adapter_pull import pull_adapter, pull_folder
from stitchboard.trainer_client.cli import pull as pull_command
from stitchboard.trainer_client.errors import AdapterRefusedError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.served_view import served_view

BASE = "tiny/llama-lora-base"
TARGETS = ["q_proj", "v_proj"]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A two-layer Llama (hidden 64, vocab 64, tied embeddings), float32, seeded, named :data:`BASE`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = BASE  # as from_pretrained(BASE) sets it
    return model


def lora(seed: int = 0, **config: Any) -> torch.nn.Module:
    """A PEFT LoRA model over :func:`tiny_llama` (r=8, alpha=16, q/v unless ``config`` says otherwise)."""
    options: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS, "init_lora_weights": False}
    options.update(config)
    torch.manual_seed(seed + 1)
    with warnings.catch_warnings():  # PEFT warns of the tied head for modules_to_save and trainable tokens
        warnings.simplefilter("ignore", UserWarning)
        return get_peft_model(tiny_llama(seed), LoraConfig(**options))


def adamw_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Real AdamW steps on a fixed batch (next-token loss)."""
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()


def bf16_adapter(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """PEFT's own adapter state dict cast to bf16, as raw bits (what a version must hold)."""
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {n: t.detach().to(torch.bfloat16).view(torch.int16).numpy().ravel().copy() for n, t in state.items()}


def test_lora_versions_publish_pull_bit_exact_and_the_run_plans_squashes_and_gcs(
    bulletin, run: str, bulletin_store: Path, tmp_path: Path
) -> None:
    with Publisher(bulletin.url, f"{run}-base") as full:  # the base as a full run
        base_manifest = bulletin.client().manifest(f"{run}-base", full.publish(tiny_llama()).version)
    model = lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    expected = []
    # versions 0-2 taken whole (squashes need the whole view), then a resumed publisher streams 3 and 4
    for versions, squash_depths in ((range(3), (2,)), (range(3, 5), ())):
        with Publisher(bulletin.url, run, encoding="xor", snapshot_every=3, squash_depths=squash_depths) as publisher:
            for version in versions:
                assert publisher._can_stream() == (version > 0 and not squash_depths)
                assert publisher.publish(model, step=version).version == version
                expected.append(bf16_adapter(model))
                adamw_steps(model, opt, 1)
    client = bulletin.client()
    spec = client.manifest(run, 0).adapter
    assert spec is not None and (spec.base_model, spec.r, spec.lora_alpha, spec.target_modules) == (
        BASE,
        8,
        16,
        TARGETS,
    )
    assert spec.base_checksum == view_checksum(base_manifest.checksums())  # a full run's anchor of the base
    assert all(client.manifest(run, v).adapter == spec for v in range(5))
    changed = [client.manifest(run, v).stats for v in range(1, 5)]
    assert all(s.changed_elements > 0.3 * s.total_elements for s in changed), changed  # LoRA steps are dense
    for version, want in enumerate(expected):
        folder = tmp_path / f"v{version}"
        pull_adapter(client, run, folder, version)
        got = load_checkpoint(folder / "adapter_model.safetensors")
        assert set(got) == set(want) and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in got)
        for name, bits in want.items():
            assert got[name].dtype == "BF16" and np.array_equal(got[name].bits.view(np.int16), bits), name
    config = json.loads((tmp_path / "v4" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["inference_mode"] and config["base_model_name_or_path"] == BASE
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "v4")  # PEFT loads the pulled folder unchanged
    assert {
        n: t.to(torch.bfloat16).view(torch.int16).numpy()
        for n, t in get_peft_model_state_dict(loaded, save_embedding_layers=False).items()
    }.keys() == expected[4].keys()
    for name, t in get_peft_model_state_dict(loaded, save_embedding_layers=False).items():
        assert np.array_equal(t.to(torch.bfloat16).view(torch.int16).numpy().ravel(), expected[4][name]), name

    # plans: from version 0 to 4 the planner takes the anchor at 3, whose snapshot is smaller than deltas 1-3
    infos = {i.version: i for i in client.versions(run)}
    assert infos[3].snapshot and infos[3].snapshot_bytes < sum(infos[v].size_bytes for v in (1, 2, 3)), infos
    steps = client.plan(run, 0, 4).steps
    assert [(s.kind, s.version) for s in steps] == [("snapshot", 3), ("delta", 4)]
    squashes = client.squashes(run)  # stored where smaller than the two deltas it replaces
    assert [(s.base_version, s.target_version) for s in squashes] == [(0, 2)], squashes
    route = client.plan(run, 0, 2, squash=True).steps
    assert [(s.kind, s.base_version, s.version) for s in route] == [("squash", 0, 2)], route

    # gc keeps the latest anchor and what follows it; the adapter run pulls bit for bit after it
    report = collect_garbage(Ledger(open_store(f"file://{bulletin_store}")), 1, 0.0, runs=[run])
    assert report.versions_removed == {run: [0, 1, 2]}
    result = CliRunner().invoke(
        _pull_app(), ["--bulletin", bulletin.url, "--run", run, "-o", str(tmp_path / "cli"), "--adapter"]
    )
    assert result.exit_code == 0 and "LoRA adapter r=8" in result.output, result.output
    got = load_checkpoint(tmp_path / "cli" / "adapter_model.safetensors")
    assert all(np.array_equal(got[n].bits.view(np.int16), bits) for n, bits in expected[4].items())
    with pytest.raises(AdapterRefusedError, match="full run"):
        pull_adapter(client, f"{run}-base", tmp_path / "full")
    assert not (tmp_path / "full").exists()
    pull_folder(client, f"{run}-base", tmp_path / "full")  # a full run's version: a plain checkpoint as before
    assert (tmp_path / "full" / "model.safetensors").is_file()


def _pull_app() -> Any:
    import typer

    app = typer.Typer()
    app.command()(pull_command)
    return app


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
    ],
)
def test_publish_refuses_what_an_adapter_run_does_not_serve(bulletin, run: str, config: dict, field: str) -> None:
    with Publisher(bulletin.url, run) as publisher, pytest.raises(AdapterRefusedError) as caught:
        publisher.publish(lora(**config))
    assert caught.value.details["field"] == field and field in caught.value.message
    assert bulletin.client().latest(run) is None  # nothing published


@pytest.mark.parametrize("served", ["fp8", "nvfp4"])
def test_a_quantized_served_base_under_a_bf16_adapter_is_refused_with_the_reason(bulletin, run, served) -> None:
    with Publisher(bulletin.url, run, served=served) as publisher, pytest.raises(AdapterRefusedError) as caught:
        publisher.publish(lora())
    assert caught.value.details == {"field": "served", "value": served}
    assert "FP8 or NVFP4 base under a bf16 adapter is not served" in caught.value.message
    assert bulletin.client().latest(run) is None  # nothing published


def test_publish_refuses_other_peft_types_a_missing_config_and_changes_between_versions(bulletin, run: str) -> None:
    with Publisher(bulletin.url, run) as publisher:
        loha = get_peft_model(tiny_llama(), LoHaConfig(r=2, target_modules=TARGETS))
        with pytest.raises(AdapterRefusedError, match="peft_type") as caught:
            publisher.publish(loha)
        assert caught.value.details == {"field": "peft_type", "value": "LOHA"}
        unconfigured = lora()
        unconfigured.peft_config.clear()
        with pytest.raises(AdapterRefusedError, match="peft_config"):
            publisher.publish(unconfigured)
        publisher.publish(lora())
        for other, field in (
            (lora(r=4), "r"),
            (lora(lora_alpha=32), "lora_alpha"),
            (lora(target_modules=["q_proj"]), "target_modules"),
        ):
            with pytest.raises(AdapterRefusedError, match=field) as caught:
                publisher.publish(other)
            assert caught.value.details["field"] == field
        with pytest.raises(AdapterRefusedError, match="adapter run") as caught:
            publisher.publish(tiny_llama())  # a full model to an adapter run
        assert caught.value.details["field"] == "adapter"
        assert publisher.last_version == 0
    with Publisher(bulletin.url, f"{run}-full") as publisher:
        publisher.publish(tiny_llama())
        with pytest.raises(AdapterRefusedError, match="full run"):
            publisher.publish(lora())


def test_a_resumed_publisher_and_the_bulletin_refuse_a_changed_adapter(bulletin, run: str) -> None:
    with Publisher(bulletin.url, run) as publisher:
        publisher.publish(lora())
    for model, field in ((lora(r=4), "r"), (tiny_llama(), "adapter")):
        with Publisher(bulletin.url, run) as resumed, pytest.raises(AdapterRefusedError) as caught:
            resumed.publish(model)  # the resumed publisher reads the run's spec: refused before any upload
        assert caught.value.details["field"] == field, caught.value.body()
    # the bulletin's own check, for a publisher that skips the SDK's: version 1 with another rank, or none
    client = bulletin.client()
    v0 = client.manifest(run, 0)
    assert v0.adapter is not None
    other_rank = v0.adapter.model_copy(update={"r": 4, "config": {**v0.adapter.config, "r": 4}})
    for adapter, field, base_value, value in ((other_rank, "r", 8, 4), (None, "adapter", "adapter", "full")):
        v1 = v0.model_copy(update={"version": 1, "base_version": 0, "adapter": adapter})
        with pytest.raises(AdapterMismatchError) as mismatch:
            client.publish(v1)
        assert mismatch.value.status == 409 and mismatch.value.details["field"] == field, mismatch.value.body()
        assert (mismatch.value.details["base_value"], mismatch.value.details["value"]) == (base_value, value)
        assert "new run" in mismatch.value.message
    assert client.latest(run) == 0


def test_base_checksum_is_the_full_runs_view_without_lora_names() -> None:
    model = lora()
    from stitchboard.proto.codec import checksum
    from stitchboard.trainer_client.adapter_run import base_view_checksums

    want = {n: checksum(t) for n, t in served_view(tiny_llama()).items()}
    assert base_view_checksums(model) == want
