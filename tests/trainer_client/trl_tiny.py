"""A tiny real TRL ``GRPOTrainer`` and a token-level engine for the TRL integration tests (pytest process).

* :func:`tiny_tokenizer` / :func:`tiny_model`: a character-level tokenizer with a chat template and a
  one-layer Llama (tied embeddings, ~2k parameters), built in memory: no download, a step in ~0.3 s.
* :func:`grpo_trainer`: a real ``GRPOTrainer`` over them (``use_vllm=False``, ``beta=0``), a reward that
  scores completion length, and whatever callbacks and ``rollout_func`` a test passes.
* :class:`TokenEngine`: the sidecar tests' :class:`~tests.sidecar.fake_engine.FakeEngine` (the adapter
  seam: real patches on real bits) whose OpenAI server answers as vLLM does for token-id prompts:
  ``n`` choices, ``token_ids`` (``return_token_ids``), ``logprobs.token_logprobs``, ``usage``.
* :func:`serve_sidecar`: a real sidecar app on loopback in front of such an engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from stitchboard.bulletin.client import BulletinClient
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import FAST_SIDECAR
from tests.support.app_server import AppServer

CHARS = "abcdefghijklmnopqrstuvwxyz ?.:"
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
PROMPTS = ["abc", "hello", "why ?", "xyz"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of :data:`CHARS`, plus pad/eos/unk; a chat template ``u:<text>.a:``."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A one-layer Llama over :data:`VOCAB` (hidden 16, tied embeddings), float32, seeded."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Longer completions score higher (a real reward: it moves the weights)."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def grpo_trainer(
    out: Path,
    *,
    steps: int = 3,
    callbacks: list[TrainerCallback] | None = None,
    rollout_func: Callable[..., dict[str, Any]] | None = None,
    conversational: bool = False,
    reward: Callable[..., list[float]] = length_reward,
    num_generations: int = 2,
) -> Any:
    """A real ``GRPOTrainer`` on :func:`tiny_model` (4 prompts a step, ``num_generations`` each, 4 new tokens)."""
    from trl import GRPOConfig, GRPOTrainer

    prompts: list[Any] = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else list(PROMPTS)
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2 * num_generations,
        num_generations=num_generations,
        max_completion_length=4,
        max_steps=steps,
        use_vllm=False,
        report_to=[],
        save_strategy="no",
        beta=0.0,
        learning_rate=0.05,
        use_cpu=True,
        logging_steps=1,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    return GRPOTrainer(
        model=tiny_model(),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
        processing_class=tiny_tokenizer(),
        callbacks=callbacks,
        rollout_func=rollout_func,
    )


class TokenEngine(FakeEngine):
    """A :class:`FakeEngine` whose ``/v1/completions`` answers token-id prompts as vLLM does.

    Each choice's tokens are drawn from the vocabulary by a hash of the prompt, the choice index
    and the engine's weights (honouring pauses, as the fake engine's tokens do). ``requests`` holds
    every body the engine received.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("token_delay_s", 0.0)
        super().__init__(*args, **kwargs)
        self.requests: list[dict[str, Any]] = []

    def _choice(self, prompt: list[int], index: int, length: int) -> list[int]:
        seed = hashlib.sha256(f"{prompt}/{index}/{self.fp}".encode()).digest()
        return [3 + seed[i] % len(CHARS) for i in range(length)]

    def app(self) -> FastAPI:
        app = super().app()
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/completions"]
        engine = self

        @app.post("/v1/completions")
        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            engine.requests.append(body)
            engine.started += 1
            length = int(body.get("max_tokens", 4))
            choices = []
            for index in range(int(body.get("n") or 1)):
                for i in range(length):
                    await engine._token(i)
                ids = engine._choice(body["prompt"], index, length)
                choice: dict[str, Any] = {"index": index, "text": "", "finish_reason": "length"}
                choice["logprobs"] = {"token_logprobs": [-1.0] * length, "tokens": [str(t) for t in ids]}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids
                choices.append(choice)
            engine.completed += 1
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": length * len(choices)}
            return JSONResponse(
                {"id": "cmpl-1", "object": "text_completion", "model": "fake", "choices": choices, "usage": usage}
            )

        return app


def serve_sidecar(
    bulletin: str, run: str, engine: FakeEngine, workdir: Path, **overrides: Any
) -> tuple[AppServer, AppServer, BulletinClient]:
    """Serve ``engine``'s HTTP API and a real sidecar in front of it on loopback: (sidecar, engine server,
    its client)."""
    engine_server = AppServer(engine.app())
    engine.url = engine_server.url
    settings = SidecarSettings(
        **{
            "bulletin": bulletin,
            "run": run,
            "engine_url": engine.url,
            "handoff_dir": str(workdir / "handoff"),
            **FAST_SIDECAR,
            **overrides,
        }
    )
    client = BulletinClient(bulletin, retries=1, backoff_s=0.01)
    return AppServer(create_sidecar(settings, engine=engine, client=client)), engine_server, client
