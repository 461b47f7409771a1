"""TRL's AsyncGRPOTrainer with ``weight_transfer=WeightTransfer(...)`` (trainer_client/trl/weight_transfer.py).

The real trainer trains a tiny Llama on this CPU; its rollout worker (a child process) generates through a real
sidecar over loopback, in front of the tests' fake engine (the seam we own: it really applies the patches), and
each weight sync publishes a version to a real bulletin. Two CPU shims, confined to the ``cpu_async_grpo``
fixture: ``torch.cuda.get_device_name`` (AsyncGRPOTrainer asks for the GPU's name for its MFU metric) and the
tree-attention kernel TRL fetches from a model hub (FA3's ``flash_attn_varlen_func``, replaced by the same
computation in plain torch). Neither is part of stitchboard.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi import Request

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.codec import checksum
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from stitchboard.trainer_client.errors import PublishError
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.trl.weight_transfer import WeightTransfer
from tests.sidecar.fake_engine import FakeEngine
from tests.support.app_server import AppServer

trl_async = pytest.importorskip("trl.experimental.async_grpo")

WORDS = ["</s>", "<user>", "<assistant>", "a", "b", "c", "d", "e", "f", "g", "h"]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def cpu_flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, **_):
    """FA3's ``flash_attn_varlen_func`` in plain torch: per packed segment, causal attention aligned to its end
    (query j sees key t when t <= j + len_k - len_q), key/value heads repeated for grouped queries."""
    heads = q.shape[1]
    out = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(heads // k.shape[1], dim=0)
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(heads // v.shape[1], dim=0)
        scores = qi @ ki.transpose(1, 2) * (softmax_scale or qi.shape[-1] ** -0.5)
        lq, lk = qi.shape[1], ki.shape[1]
        if causal:
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def cpu_async_grpo(monkeypatch) -> None:
    """The two shims AsyncGRPOTrainer needs on a CPU (see the module docstring), for this test only."""
    from trl.experimental.async_grpo import packing

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu")
    monkeypatch.setattr(packing, "_flash_attn", lambda: SimpleNamespace(flash_attn_varlen_func=cpu_flash_attn_varlen))


def tiny_checkpoint(folder: Path):
    """A word-level tokenizer with a chat template and a tiny float32 Llama over its vocabulary, saved to ``folder``;
    returns the tokenizer and the model's served view."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_template

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="</s>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.response_template = qwen3_template  # how to parse an answer (plain text here: no tool-call tags)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer, served_view(model)


class TokenEngine(FakeEngine):
    """The fake engine answering ``/v1/completions`` as vLLM does for TRL's rollout worker (``return_token_ids``,
    ``logprobs``): word tokens produced one at a time (pausable, as the fake engine's), then end of sequence."""

    def app(self):
        app = super().app()
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/completions"]
        engine = self

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            engine.started += 1
            n = int(body.get("max_tokens", 4))
            draw = np.random.default_rng(body["seed"])  # TRL seeds each request: a group's answers differ
            ids = [int(t) for t in draw.integers(3, len(WORDS), n - 1)] + [0]
            for i in range(n):
                await engine._token(i)
            engine.completed += 1
            text = " ".join(WORDS[t] for t in ids)
            choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * n}}
            return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}

        return app


def a_reward(completions: list, **_: object) -> list[float]:
    """A real reward (how many ``a`` the answer holds), module-level: the rollout worker's child unpickles it."""
    return [float(json.dumps(c).count(" a")) for c in completions]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A bulletin, and a sidecar following a fresh run in front of a :class:`TokenEngine`, all on loopback."""
    run = f"trl-{uuid.uuid4().hex[:8]}"
    bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05)))
    engine = TokenEngine(token_delay_s=0.001)
    engine_server = AppServer(engine.app())
    engine.url = engine_server.url
    client = BulletinClient(bulletin.url, retries=1, backoff_s=0.01)
    settings = SidecarSettings(
        bulletin=bulletin.url,
        run=run,
        engine_url=engine.url,
        handoff_dir=str(tmp_path / "handoff"),
        poll_wait_s=5.0,
        retry_backoff_s=0.05,
        max_backoff_s=0.2,
        request_wait_s=30.0,
    )
    sidecar = AppServer(create_sidecar(settings, engine=engine, client=client))
    yield SimpleNamespace(run=run, bulletin=bulletin, engine=engine, sidecar=sidecar, client=client)
    for server in (sidecar, engine_server, bulletin):
        server.stop()
    client.close()


@pytest.mark.slow  # TRL's rollout worker is a child process (docs/testing.md, the slow tier)
def test_async_grpo_publishes_every_sync_bit_exact(stack, cpu_async_grpo, tmp_path: Path) -> None:
    from datasets import Dataset

    folder = tmp_path / "model"
    tokenizer, initial = tiny_checkpoint(folder)
    config = trl_async.AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        num_generations=4,
        max_completion_length=8,
        per_device_train_batch_size=4,
        token_budget=0,
        max_inflight_tasks=4,
        queue_maxsize=8,
        learning_rate=0.05,
        weight_sync_steps=1,
        vllm_server_base_url=stack.sidecar.url,
        request_timeout=60,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": w}] for w in "abcdefgh"]})
    transfer = WeightTransfer(stack.bulletin.url, stack.run, fleet_timeout_s=60.0, encoding="xor")
    trainer = trl_async.AsyncGRPOTrainer(
        model=str(folder),
        reward_funcs=a_reward,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        weight_transfer=transfer,
    )
    transfer.attach(trainer)
    trainer.train()

    # one version per sync: the cold sync before the rollout worker starts (step 0), then one per optimizer step
    assert transfer.published == [(0, 0), (1, 1), (2, 2)]
    assert [stack.client.manifest(stack.run, v).metadata["step"] for v in range(3)] == [0, 1, 2]
    assert transfer.publisher is None  # destroy() closed it
    view = served_view(trainer.model)
    assert set(stack.engine.weights) == set(view)
    for name, raw in view.items():
        assert np.array_equal(stack.engine.weights[name].bits, raw.bits), name
    assert any(not np.array_equal(initial[n].bits, view[n].bits) for n in view)  # it trained
    assert stack.engine.started >= 8  # the rollouts went through the sidecar


def test_send_weights_consumes_the_iterator_once_lazily(bulletin, run) -> None:
    """Each tensor is cast before the next is taken (memory: one tensor beyond the view), and never twice; a frozen
    parameter, which TRL does not stream, is taken from the model, so the version holds the whole view."""
    from tests.trainer_client.watch_frameworks import tiny_llama

    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=7), model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer = WeightTransfer(bulletin.url, run, wait_for_fleet=False).attach(trainer)
    transfer.init_weight_transfer()
    cast: list[str] = []
    taken: list[str] = []
    real_cast = transfer._cast

    def spy_cast(name, tensor):
        cast.append(name)
        return real_cast(name, tensor)

    transfer._cast = spy_cast

    def stream():
        for name, param in ((n, p) for n, p in model.named_parameters() if p.requires_grad):  # as TRL streams
            assert cast == taken, "a tensor was taken before the previous one was cast"
            taken.append(name)
            yield name, param.detach()

    it = stream()
    transfer.send_weights(it)
    assert next(it, None) is None and taken == [n for n, p in model.named_parameters() if p.requires_grad]
    assert transfer.published == [(7, 0)]
    view = served_view(model)
    with BulletinClient(bulletin.url) as client:
        manifest = client.manifest(run, 0)
    assert {t.name: t.checksums["xxh3_128"] for t in manifest.tensors} == {n: checksum(raw) for n, raw in view.items()}
    assert manifest.metadata["step"] == 7
    transfer.destroy()
    again = WeightTransfer(bulletin.url, run, wait_for_fleet=False).attach(trainer)  # a restarted trainer
    again.init_weight_transfer()
    again.send_weights((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)
    assert again.published == [(7, 0)]  # the same step with the same bits: that version, no new one
    again.destroy()


def test_bulletin_down_names_the_step(tmp_path: Path) -> None:
    bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{tmp_path / 'store'}")))
    from tests.trainer_client.watch_frameworks import tiny_llama

    model = tiny_llama()
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=3), model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer = WeightTransfer(bulletin.url, "r1", wait_for_fleet=False, retries=0, backoff_s=0.01).attach(trainer)
    transfer.init_weight_transfer()
    bulletin.stop()
    with pytest.raises(PublishError, match="step 3: the bulletin at .* was unreachable"):
        transfer.send_weights((n, p.detach()) for n, p in model.named_parameters())
    transfer.destroy()


def test_a_refused_publish_says_refused_not_unreachable(bulletin, run) -> None:
    """A 409 (a step going back, other bits at the run's last step) is worded as the bulletin's refusal, with what to
    do, never as an unreachable bulletin to start."""
    from tests.trainer_client.watch_frameworks import tiny_llama

    model = tiny_llama()
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=5), model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer = WeightTransfer(bulletin.url, run, wait_for_fleet=False).attach(trainer)
    transfer.init_weight_transfer()
    transfer.send_weights((n, p.detach()) for n, p in model.named_parameters())
    for step, bump in ((3, 0.0), (5, 1.0)):  # a step going back; other bits at step 5
        trainer.state.global_step = step
        with pytest.raises(PublishError) as refused:
            transfer.send_weights((n, p.detach() + bump) for n, p in model.named_parameters())
        message = str(refused.value)
        assert f"step {step}: the bulletin refused" in message and "409 VersionConflict" in message, message
        assert "resume the trainer" in message and "Start the bulletin" not in message, message
    assert transfer.published == [(5, 0)]
    transfer.destroy()


def _stream_with(model, name: str, replace) -> Iterator[tuple[str, torch.Tensor]]:
    for n, p in model.named_parameters():
        if n == name:
            yield from replace(p.detach())
        else:
            yield n, p.detach()


@pytest.mark.parametrize(
    ("how", "replace", "expected"),
    [
        ("a local shard", lambda t: [("W", t[: t.shape[0] // 2])], r"as \(16, 64\) torch.float32, but the model's"),
        ("int32", lambda t: [("W", t.to(torch.int32))], r"as \(32, 64\) torch.int32: parameters are floating"),
        ("float64", lambda t: [("W", t.double())], r"torch.float64, but the model's .* torch.float32"),
        ("twice, the second zeros", lambda t: [("W", t), ("W", torch.zeros_like(t))], "twice in one weight sync"),
    ],
)
def test_a_streamed_tensor_unlike_the_models_is_refused(bulletin, run, how, replace, expected) -> None:
    """A tensor the model's parameter cannot be (another shape, as a local shard; another dtype; not floating point;
    streamed twice, last-wins) is refused before anything is published, naming it with its shape and dtype."""
    from tests.trainer_client.watch_frameworks import tiny_llama

    model = tiny_llama()
    name = "model.layers.0.mlp.down_proj.weight"
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=1), model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer = WeightTransfer(bulletin.url, run, wait_for_fleet=False).attach(trainer)
    transfer.init_weight_transfer()
    stream = _stream_with(model, name, lambda t: [(name if n == "W" else n, x) for n, x in replace(t)])
    with pytest.raises(PublishError, match=expected) as refused:
        transfer.send_weights(stream)
    assert name in str(refused.value), how
    assert transfer.published == [] and transfer.publisher is not None and transfer.publisher.last_version is None
    transfer.destroy()


def test_a_streamed_name_the_model_lacks_is_refused(bulletin, run) -> None:
    """A name that is no checkpoint name of the model (fused MoE experts) is refused, naming it; nothing published."""
    from tests.trainer_client.watch_frameworks import tiny_llama

    model = tiny_llama()
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=1), model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer = WeightTransfer(bulletin.url, run, wait_for_fleet=False).attach(trainer)
    transfer.init_weight_transfer()
    fused = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 4, 4))]
    with pytest.raises(PublishError, match="gate_up_proj"):
        transfer.send_weights(iter(fused))
    assert transfer.published == [] and transfer.publisher is not None and transfer.publisher.last_version is None
    transfer.destroy()
