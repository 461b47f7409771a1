"""``Watcher`` (``stitchboard watch``) in-process: each framework's layout written as the framework writes it
after real AdamW steps, a real bulletin on loopback, every version pulled back bit-exact against the served
view of the same weights; and the faults (deleted or rewritten mid-read, truncated, pickles, DCP, PEFT,
a gap in steps, the wrong layout)."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stitchboard.bulletin.client import BulletinClient
from stitchboard.trainer_client import watch_layouts
from stitchboard.trainer_client.errors import WatchLayoutError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.watch import Watcher
from stitchboard.trainer_client.watch_layouts import LAYOUTS, pattern_layout
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of
from tests.trainer_client.watch_frameworks import (
    bf16_state,
    llama_step,
    tiny_llama,
    write_hf_checkpoint,
    write_nemo_rl,
    write_prime_rl,
    write_shards,
)


class Watch:
    """A :class:`Watcher` on ``root`` for a fresh run, its client, and the lines it printed."""

    def __init__(self, url: str, run: str, root: Path, workdir: Path, **kwargs) -> None:
        self.client = BulletinClient(url, retries=1, backoff_s=0.05)
        self.lines: list[str] = []
        options = {"workdir": workdir, **kwargs.pop("options", {})}
        self.watcher = Watcher(root, run, self.client, say=self.lines.append, options=options, **kwargs)
        self.watcher.resume()

    def poll(self) -> list[tuple[int, str, int | None]]:
        return [(o.step, o.status, o.version) for o in self.watcher.poll()]

    def close(self) -> None:
        self.watcher.close()
        self.client.close()


@pytest.fixture
def watch(bulletin, run, tmp_path) -> Iterator:
    made: list[Watch] = []

    def make(root: Path, **kwargs) -> Watch:
        made.append(Watch(bulletin.url, run, root, tmp_path / "work", **kwargs))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _steps(client: BulletinClient, run: str) -> list[int]:
    return [client.manifest(run, i.version).metadata["step"] for i in client.versions(run)]


def test_prime_rl_broadcasts_publish_in_step_order(watch, run, tmp_path):
    """Steps 1-3 (step 2 sharded) publish as versions 0-2; step 4, written but without STABLE, waits for it."""
    root = tmp_path / "broadcasts"
    w = watch(root, layout=LAYOUTS["prime-rl"])
    assert w.poll() == []  # the framework has not made its folder yet
    trainer, views = ToyTrainer(), {}
    for step in (1, 2, 3, 4):
        trainer.step()
        views[step] = view_of(trainer.model)
        write_prime_rl(root, step, bf16_state(trainer.model), max_shard_bytes=4096 if step == 2 else None)
    (root / "step_4" / "STABLE").unlink()  # still being written
    assert w.poll() == [(1, "published", 0), (2, "published", 1), (3, "published", 2)]
    assert w.poll() == []
    (root / "step_4" / "STABLE").touch()
    assert w.poll() == [(4, "published", 3)]
    for version, step in enumerate((1, 2, 3, 4)):
        assert_same_view(rebuild_version(w.client, run, version).view, views[step])
        assert w.client.manifest(run, version).metadata == {"step": step, "checkpoint": f"step_{step}"}
    assert any(line.startswith("step 2 -> version 1: ") and "% changed" in line for line in w.lines), w.lines
    assert not any("passed over" in line for line in w.lines), w.lines

    for step in (5, 6):  # step 5 never completes (a crashed save), step 6 does
        trainer.step()
        write_prime_rl(root, step, bf16_state(trainer.model))
    (root / "step_5" / "STABLE").unlink()
    assert w.poll() == [(6, "published", 4)]
    assert w.lines[-1] == "step 5: step_5 was not complete when step 6 was; passed over"
    (root / "step_5" / "STABLE").touch()
    assert w.poll() == []  # versions only move forward
    assert_same_view(rebuild_version(w.client, run, 4).view, view_of(trainer.model))


def test_nemo_rl_exports_appear_by_rename(watch, run, tmp_path):
    """An export is read once renamed to version_NNNNNNNN (auto layout), never under its temporary name."""
    root = tmp_path / "exports"
    w = watch(root)
    trainer, views = ToyTrainer(), {}
    for version in (3, 4):
        trainer.step()
        views[version] = view_of(trainer.model)
        write_shards(root / f".tmp-version_{version:08d}", bf16_state(trainer.model), None)
    assert w.poll() == []
    for version in (3, 4):
        os.rename(root / f".tmp-version_{version:08d}", root / f"version_{version:08d}")
    assert w.poll() == [(3, "published", 0), (4, "published", 1)]
    assert_same_view(rebuild_version(w.client, run, 1).view, views[4])
    trainer.step()
    write_nemo_rl(root, 5, bf16_state(trainer.model))
    assert w.poll() == [(5, "published", 2)]
    assert_same_view(rebuild_version(w.client, run, 2).view, view_of(trainer.model))


def test_hf_trainer_checkpoints_from_the_real_trainer(watch, run, tmp_path):
    """``transformers.Trainer`` (save_steps=1) writes checkpoint-1..3 of a tied fp32 Llama; the watcher,
    polled from the Trainer's on_save, publishes each as the bf16 view the SDK publishes of the live
    model, with its config and tokenizer-free assets from the first checkpoint."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    root = tmp_path / "out"
    w = watch(root, layout=LAYOUTS["hf-trainer"])
    model = tiny_llama()
    views, published = {}, []

    class PollOnSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            views[state.global_step] = view_of(model)
            published.extend(w.poll())

    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(root), max_steps=3, save_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": r, "labels": r} for r in ids]
    Trainer(model=model, args=args, train_dataset=data, callbacks=[PollOnSave()]).train()
    assert published == [(1, "published", 0), (2, "published", 1), (3, "published", 2)]
    for version, step in enumerate((1, 2, 3)):
        rebuilt = rebuild_version(w.client, run, version)
        assert_same_view(rebuilt.view, views[step])
        assert "lm_head.weight" not in rebuilt.view
    assert {a.path for a in w.client.plan(run, None, 0).steps[0].files if a.role == "asset"} >= {"config.json"}


def test_hf_trainer_waits_for_every_indexed_shard(watch, run, tmp_path):
    root = tmp_path / "out"
    w = watch(root, layout=LAYOUTS["hf-trainer"])
    model = tiny_llama()
    folder = write_hf_checkpoint(root, 5, model, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    held = shards[-1].rename(tmp_path / shards[-1].name)  # trainer_state.json there, a shard not yet
    assert w.poll() == []
    held.rename(shards[-1])
    assert w.poll() == [(5, "published", 0)]
    assert_same_view(rebuild_version(w.client, run, 0).view, view_of(model))


def test_the_served_recipe_and_tied_head_as_the_sdk_publishes_them(watch, bulletin, run, tmp_path):
    """A prime-rl broadcast holding ``lm_head.weight`` beside the embedding it is tied to, published with
    ``served="fp8"``: the same manifest tensors (names, dtypes, shapes, checksums) as the SDK's publish of
    the live model; a head that differs from the embedding is refused naming both."""
    root, assets = tmp_path / "broadcasts", tmp_path / "model"
    model = tiny_llama()
    model.config.save_pretrained(assets)
    w = watch(root, assets=assets, options={"served": "fp8"})
    sdk_run = f"{run}-sdk"
    with Publisher(bulletin.url, sdk_run, served="fp8", assets=assets, workdir=tmp_path / "sdk") as sdk:
        for step in (1, 2):
            llama_step(model, step)
            write_prime_rl(root, step, {n: t.detach().clone() for n, t in model.state_dict().items()})
            sdk.publish(model, step=step)
    assert w.poll() == [(1, "published", 0), (2, "published", 1)]
    for version in (0, 1):
        mine, theirs = w.client.manifest(run, version), w.client.manifest(sdk_run, version)
        assert mine.served == theirs.served == "fp8"
        assert mine.tensors == theirs.tensors and "lm_head.weight" not in mine.tensor_map()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    state["lm_head.weight"][0, 0] += 1.0
    write_prime_rl(root, 3, state)
    assert w.poll() == [(3, "failed", None)]
    assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in w.lines[-1]


def test_a_checkpoint_deleted_while_read_is_skipped(watch, run, tmp_path, monkeypatch):
    root = tmp_path / "broadcasts"
    w = watch(root)
    trainer = ToyTrainer()
    write_prime_rl(root, 1, bf16_state(trainer.model), max_shard_bytes=4096)
    trainer.step()
    write_prime_rl(root, 2, bf16_state(trainer.model))
    read = watch_layouts.read_shard

    def deleting(path: Path):
        tensors = read(path)
        if path.parent.name == "step_1":
            shutil.rmtree(path.parent)  # the framework cleans old broadcasts
        return tensors

    monkeypatch.setattr(watch_layouts, "read_shard", deleting)
    assert w.poll() == [(1, "skipped", None), (2, "published", 0)]
    assert "step 1: " in w.lines[1] and "deleted while read; skipped" in w.lines[1], w.lines
    assert_same_view(rebuild_version(w.client, run, 0).view, view_of(trainer.model))


def test_a_checkpoint_rewritten_while_read_is_read_again(watch, run, tmp_path, monkeypatch):
    """prime-rl broadcasts a step again (a restarted trainer): its shard, written under a temporary name,
    is renamed over the one being read; that read is dropped and the next pass publishes the new bits."""
    root = tmp_path / "broadcasts"
    w = watch(root)
    trainer = ToyTrainer()
    write_prime_rl(root, 1, bf16_state(trainer.model))
    trainer.step()
    read = watch_layouts.read_shard

    def rewriting(path: Path):
        tensors = read(path)
        monkeypatch.setattr(watch_layouts, "read_shard", read)
        write_shards(tmp_path / "again", bf16_state(trainer.model), None)
        os.replace(tmp_path / "again" / "model.safetensors", path)
        return tensors

    monkeypatch.setattr(watch_layouts, "read_shard", rewriting)
    assert w.poll() == [(1, "retry", None)]
    assert "changed while read; read again at the next pass" in w.lines[-1]
    assert w.poll() == [(1, "published", 0)]
    assert_same_view(rebuild_version(w.client, run, 0).view, view_of(trainer.model))


def test_refused_and_malformed_checkpoints_are_named_and_the_next_good_one_publishes(watch, run, tmp_path):
    """A truncated shard, pickled weights, DCP shards, a PEFT adapter: each is reported once, naming its
    file (and the setting that writes a full safetensors checkpoint); the good steps around them publish,
    across the gap they leave in the steps; a refused checkpoint whose files change is read again."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "broadcasts"
    w = watch(root)
    trainer, views = ToyTrainer(), {}
    for step in range(1, 9):
        trainer.step()
        views[step] = view_of(trainer.model)
        if step != 6:  # a gap in the steps
            write_prime_rl(root, step, bf16_state(trainer.model))
    for step in (2, 8):
        shard = root / f"step_{step}" / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    for step in (3, 4, 5):
        (root / f"step_{step}" / "model.safetensors").unlink()
    torch.save(trainer.model.state_dict(), root / "step_3" / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: no process group, saving as one process
        dcp.save({"model": trainer.model.state_dict()}, checkpoint_id=str(root / "step_4" / "pytorch_model_fsdp_0"))
    (root / "step_5" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    adapter = {"base_model.model.0.lora_A.weight": torch.zeros(8, 32)}
    save_file(adapter, str(root / "step_5" / "adapter_model.safetensors"))

    assert w.poll() == [
        (1, "published", 0),
        (2, "failed", None),
        (3, "failed", None),
        (4, "failed", None),
        (5, "failed", None),
        (7, "published", 1),
        (8, "failed", None),
    ]
    failed = [line for line in w.lines if "not published" in line]
    assert "step_2/model.safetensors" in failed[0] and "truncated" in failed[0]
    assert "step_3/pytorch_model.bin" in failed[1] and "save_safetensors" in failed[1]
    assert "step_4/pytorch_model_fsdp_0/__0_0.distcp" in failed[2] and "FULL_STATE_DICT" in failed[2]
    assert "step_5/adapter_config.json" in failed[3] and "Publisher.publish(peft_model)" in failed[3]
    assert "docs/adapters.md" in failed[3]
    assert "step_8/model.safetensors" in failed[4]
    assert w.poll() == []  # not read again while its files stay as they are
    write_prime_rl(root, 8, bf16_state(trainer.model))
    assert w.poll() == [(8, "published", 2)]
    assert _steps(w.client, run) == [1, 7, 8]
    assert_same_view(rebuild_version(w.client, run, 1).view, views[7])
    assert_same_view(rebuild_version(w.client, run, 2).view, views[8])
    assert w.client.version_for_step(run, 2).version == 1


def test_the_wrong_layout_names_the_one_found(watch, tmp_path):
    root = tmp_path / "out"
    write_hf_checkpoint(root, 1, tiny_llama())
    with pytest.raises(WatchLayoutError, match=r"holds hf-trainer checkpoints \(checkpoint-1\), not prime-rl's step_N"):
        watch(root, layout=LAYOUTS["prime-rl"]).poll()
    write_prime_rl(root, 2, bf16_state(ToyTrainer().model))
    with pytest.raises(WatchLayoutError, match="several layouts .*hf-trainer: checkpoint-1; prime-rl: step_2"):
        watch(root).poll()
    custom = watch(root, layout=pattern_layout("checkpoint-*", "trainer_state.json"))
    assert custom.poll() == [(1, "published", 0)]


def test_a_custom_pattern_complete_once_its_files_settle(watch, run, tmp_path):
    """``--pattern 'ckpt_*' --settle-s``: a folder counts as complete once its files stayed unchanged that
    long; one still growing is not read."""
    root = tmp_path / "ckpts"
    w = watch(root, layout=pattern_layout("ckpt_*", None), settle_s=0.3)
    trainer = ToyTrainer()
    write_shards(root / "ckpt_0010", bf16_state(trainer.model), 4096)
    assert w.poll() == []  # first seen now
    time.sleep(0.4)
    (root / "ckpt_0010" / "extra.json").write_text("{}")  # still being written
    assert w.poll() == []
    time.sleep(0.4)
    assert w.poll() == [(10, "published", 0)]
    assert_same_view(rebuild_version(w.client, run, 0).view, view_of(trainer.model))
