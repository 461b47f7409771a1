"""``stitchboard watch`` on SmolLM2-135M (slow): real AdamW steps on fp32 masters, saved as an HF Trainer
checkpoint (sharded fp32 safetensors + index, ``trainer_state.json`` last) and as a prime-rl broadcast
(bf16 shards + ``STABLE``); every version rebuilt from the bulletin equals the trainer's served view."""

from __future__ import annotations

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import to_raw
from stitchboard.trainer_client.watch import Watcher
from tests.trainer_client.toy import assert_same_view
from tests.trainer_client.watch_frameworks import write_hf_checkpoint, write_prime_rl

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", ["hf-trainer", "prime-rl"])
def test_smollm2_checkpoints_publish_bit_exact(smollm2_dir, smollm2_trajectory, bulletin, tmp_path, layout):
    trainer = smollm2_trajectory.replay()
    run, root, views = f"smollm2-watch-{layout}", tmp_path / "out", []
    with BulletinClient(bulletin.url) as client:
        watcher = Watcher(root, run, client, assets=smollm2_dir, options={"workdir": tmp_path / "work"}, say=print)
        try:
            watcher.resume()
            for step in (1, 2, 3):
                trainer.step()
                views.append({n: to_raw(t) for n, t in trainer.served_view().items()})
                if layout == "hf-trainer":
                    write_hf_checkpoint(root, step, trainer.model, max_shard_size="200MB")
                else:
                    state = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}  # with lm_head
                    write_prime_rl(root, step, {n: t.bfloat16() for n, t in state.items()}, 200 << 20)
                assert [(o.step, o.version) for o in watcher.poll()] == [(step, step - 1)]
            for version, want in enumerate(views):
                assert len(want) == 272
                assert_same_view(rebuild_version(client, run, version).view, want)
        finally:
            watcher.close()
