"""SmolLM2-135M with real AdamW steps (lr 3e-6) on the CPU: every published version rebuilt from
the bulletin alone equals the trainer's served view bit for bit; a pulled version serves the
same logits in transformers as the trainer's bf16 model."""

from __future__ import annotations

import pytest
import torch

from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import pull_version, rebuild_version
from stitchboard.trainer_client.served_view import served_view, to_raw
from tests.trainer_client.toy import assert_same_view

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def trained(smollm2_dir, smollm2_trajectory, bulletin):
    """A run of STEPS + 1 versions published from the recorded trajectory's steps; yields (trainer, run, results,
    checks)."""
    trainer = smollm2_trajectory.replay()
    run = "smollm2-bitexact"
    results, checks = [], []
    with Publisher(bulletin.url, run, snapshot_every=3, assets=smollm2_dir) as pub, bulletin.client() as client:
        for step in range(STEPS + 1):
            if step:
                trainer.step()
            results.append(pub.publish_async(trainer.model, step=step))
            pub.flush()
            want = {name: to_raw(t) for name, t in trainer.served_view().items()}
            rebuilt = rebuild_version(client, run, results[-1].result().version)  # the bulletin alone
            checks.append((want, rebuilt))
    yield trainer, run, [f.result() for f in results], checks


def test_every_version_rebuilt_from_the_bulletin_is_bit_exact(trained, bulletin, capsys):
    _trainer, _run, results, checks = trained
    assert [r.version for r in results] == list(range(STEPS + 1))
    assert [r.snapshot for r in results] == [True, False, False, True, False]
    for want, rebuilt in checks:
        assert len(want) == 272
        assert_same_view(rebuilt.view, want)
    with capsys.disabled():
        print("\nversion  anchor  changed elements          changed %   patch bytes  bytes/changed")
        for r in results:
            per = f"{r.encoded_bytes / r.changed_elements:.2f}" if r.changed_elements else "-"
            print(
                f"{r.version:7d}  {'yes' if r.snapshot else 'no':6s}  {r.changed_elements:>11,} of "
                f"{r.total_elements:,}  {100 * r.changed_fraction:8.3f}  {r.encoded_bytes:>12,}  {per:>12}"
            )
    for r in results[1:]:
        assert 0.001 < r.changed_fraction < 0.05  # a real step moves ~0.5-1.5 % of the bf16 elements
        assert r.encoded_bytes < 0.05 * r.view_bytes


def test_anchors_hold_every_tensor_as_a_plain_checkpoint(trained, bulletin, tmp_path):
    _trainer, run, results, checks = trained
    with bulletin.client() as client:
        for r in results:
            if not r.snapshot:
                continue
            m = client.manifest(run, r.version)
            for ref in m.files_of("snapshot") + m.files_of("asset"):
                client.download_blob(
                    run, ref.sha256, tmp_path / f"v{r.version}" / ref.path, expected_size=ref.size_bytes
                )
            assert_same_view(load_checkpoint(tmp_path / f"v{r.version}"), checks[r.version][0])
            assert {f.path for f in m.files_of("asset")} >= {"config.json", "tokenizer.json", "chat_template.jinja"}


def test_pulled_version_serves_the_trainers_logits(trained, bulletin, smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, run, _results, _ = trained
    with bulletin.client() as client:
        pull_version(client, run, tmp_path / "pulled")
    pulled = AutoModelForCausalLM.from_pretrained(tmp_path / "pulled", dtype=torch.bfloat16).eval()
    # the trainer's bf16 model: its weights cast to bf16 in a bf16 model (rotary tables stay
    # float32, as in any bf16 load; casting the whole float32 module would round them too)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    missing, unexpected = reference.load_state_dict(trainer.served_view(), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to model.embed_tokens.weight
    assert_same_view(served_view(pulled), served_view(reference))
    ids = trainer.input_ids[:1, :32]
    with torch.no_grad():
        assert torch.equal(pulled(input_ids=ids).logits, reference(input_ids=ids).logits)
