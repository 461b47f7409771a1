"""Fixtures of the real-vLLM MoE tests: tiny MoE runs trained with real AdamW steps, and their engines.

:class:`MoeRun` is a bulletin on loopback and one run of a tiny MoE preset
(:mod:`stitchboard.demo.moe_models`), published by the trainer SDK (``Publisher.publish(model)``:
the transformers model holds its experts fused, the SDK publishes the checkpoint's per-expert
names) from :class:`tests.support.training.CpuTrainer` steps; :meth:`MoeRun.step_one_expert`
is a real AdamW step on the slice of one expert of one layer only. :class:`MoeEngines` (fixture
``moe_engines``) starts vLLM servers with the stitchboard extension on a preset and keeps one for
the session, which the oracle and routing tests share; a test brings it to version 0 with
:func:`load_version_0`. :func:`complete`, :func:`routed_rows` and :func:`engine_routing` ask
a sidecar, or an engine directly, for the experts a greedy request was routed to (the oracle and
routing tests).

Duck-typed for :class:`tests.sidecar.vllm_fixtures.SidecarProcess` (``bulletin.url``, ``run``).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support import lease
from tests.support.vllm_server import VllmServer, require_vllm

#: A prompt of the routing checks (~50 tokens: three KV blocks of 16).
ROUTING_PROMPT = "Once upon a time, in a small village by the sea, " * 4
#: The body fields asking a sidecar for the routing of a request.
ASK_ROUTING = {"return_routed_experts": True}

#: The AdamW learning rate of the MoE runs (weights ~N(0, 0.05): a few % of bf16 bits move per step).
MOE_LR = 1e-5
#: The context of every MoE engine here, tokens: the presets' ``max_position_embeddings``, so the
#: routing tests' long requests (test_vllm_routing.py) fit the engine the oracle tests used.
MOE_CONTEXT = 2048


class MoeRun:
    """A bulletin on loopback and one run of a MoE preset, published from real AdamW steps.

    Args:
        preset: ``tiny-qwen3-moe`` or ``tiny-mixtral``.
        folder: where the bulletin's store, the publisher's work files and pulled versions go.
    """

    def __init__(self, preset: str, folder: Path) -> None:
        from stitchboard.bulletin.app import create_app as create_bulletin
        from stitchboard.bulletin.client import BulletinClient
        from stitchboard.bulletin.settings import BulletinSettings
        from stitchboard.demo.moe_models import moe_preset_checkpoint
        from stitchboard.trainer_client.publisher import Publisher
        from tests.sidecar.sidecar_helpers import AppServer
        from tests.support.training import CpuTrainer

        self.run = f"moe-{preset}"
        self.folder = folder
        self.model_dir = moe_preset_checkpoint(preset)
        self.bulletin = AppServer(
            create_bulletin(BulletinSettings(store=f"file://{folder / 'store'}", poll_interval_s=0.05))
        )
        self.client = BulletinClient(self.bulletin.url, retries=1, backoff_s=0.05)
        self.trainer = CpuTrainer(self.model_dir, batch_size=2, seq_len=32, lr=MOE_LR)
        self.publisher = Publisher(
            self.bulletin.url, self.run, client=self.client, workdir=folder / "publisher", assets=self.model_dir
        )
        self.publisher.publish(self.trainer.model, step=0)

    @property
    def latest(self) -> int:
        """The last published version."""
        return self.publisher.last_version

    def step(self) -> int:
        """One AdamW step on every parameter, published; returns the new version."""
        self.trainer.step()
        return self.publisher.publish(self.trainer.model, step=self.trainer.steps).version

    def step_one_expert(self, layer: int) -> tuple[int, int]:
        """One AdamW step (a fresh optimizer, no weight decay) whose gradient is kept only on one
        expert of layer ``layer`` (its gate, up and down rows: the routed expert with the largest
        gradient), published; returns ``(version, expert)``."""
        import torch

        experts = self.trainer.model.model.layers[layer].mlp.experts
        params = [experts.gate_up_proj, experts.down_proj]
        optimizer = torch.optim.AdamW(params, lr=MOE_LR, weight_decay=0.0)
        self.trainer.model.zero_grad(set_to_none=True)
        ids = self.trainer.input_ids
        self.trainer.model(input_ids=ids, labels=ids).loss.backward()
        expert = int(params[0].grad.flatten(1).abs().sum(1).argmax())
        for p in params:
            keep = torch.zeros_like(p.grad)
            keep[expert] = p.grad[expert]
            p.grad = keep
        optimizer.step()
        self.trainer.model.zero_grad(set_to_none=True)
        self.trainer.steps += 1
        return self.publisher.publish(self.trainer.model, step=self.trainer.steps).version, expert

    def sums(self, version: int) -> dict[str, str]:
        """name -> xxh3-128 of every tensor of ``version``, from its manifest."""
        return self.client.manifest(self.run, version).checksums()

    def changed(self, version: int) -> set[str]:
        """Checkpoint names whose bits changed from ``version - 1`` to ``version``."""
        old, new = self.sums(version - 1), self.sums(version)
        return {n for n in new if old[n] != new[n]}

    def patch_paths(self, version: int) -> list[str]:
        """``version``'s patch files, downloaded from the bulletin (once)."""
        out = self.folder / f"patches-v{version}"
        out.mkdir(exist_ok=True)
        return [
            str(self.client.download_blob(self.run, f.sha256, out / f.path, f.size_bytes))
            for f in self.client.manifest(self.run, version).files_of("patch")
        ]

    def pull(self, version: int) -> Path:
        """``stitchboard pull``'s folder of ``version`` (a plain checkpoint + assets), made once."""
        from stitchboard.trainer_client.resume import pull_version

        out = self.folder / f"pulled-v{version}"
        if not out.exists():
            pull_version(self.client, self.run, out, version)
        return out

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
        self.bulletin.stop()


def load_version_0(engine: VllmServer, run: MoeRun) -> None:
    """Make ``engine`` hold ``run``'s version 0 (the preset checkpoint) whatever it held, resumed."""
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    adapter = VllmEngine(engine.url, timeout_s=120)
    try:
        with lease.holding(adapter, "moe-version-0"):
            adapter.pause()
            try:
                adapter.load_snapshot([str(run.model_dir / "model.safetensors")], 0, run.sums(0))
                adapter.reset_prefix_cache()
            finally:
                adapter.resume()
    finally:
        adapter.close()


class MoeEngines:
    """The session's vLLM servers (stitchboard extension, context :data:`MOE_CONTEXT`) on MoE
    presets: ``engines(preset, tp=1)`` starts one on first use (~30 s at TP 1 on 2 cores). One is
    kept at a time (getting another stops it: a 2-core, 24 GB host runs other engines too);
    :meth:`release` stops one early. The oracle tests (test_vllm_moe.py) leave the
    ``tiny-qwen3-moe`` TP 1 engine at version 0's bits for the routing tests (test_vllm_routing.py).

    Args:
        folder: where the engines' logs go.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.engines: dict[tuple[str, int], VllmServer] = {}

    def __call__(self, preset: str, tp: int = 1) -> VllmServer:
        from stitchboard.demo.moe_models import moe_preset_checkpoint

        if (preset, tp) not in self.engines:
            self.stop_all()
            server = VllmServer(
                moe_preset_checkpoint(preset), self.folder / f"{preset}-tp{tp}.log", tp=tp, max_model_len=MOE_CONTEXT
            )
            try:
                server.wait_ready()
            except BaseException:
                server.stop()
                raise
            self.engines[(preset, tp)] = server
        return self.engines[(preset, tp)]

    def release(self, preset: str, tp: int = 1) -> None:
        """Stop the engine of ``preset`` at ``tp`` now (its memory is needed: e.g. before a fresh
        TP = 2 engine starts beside it); a later call starts a new one."""
        server = self.engines.pop((preset, tp), None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for key in list(self.engines):
            self.release(*key)


@pytest.fixture(scope="session")
def moe_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoeEngines]:
    """The session's :class:`MoeEngines`; every engine is stopped at the end of the session."""
    require_vllm()
    engines = MoeEngines(tmp_path_factory.mktemp("moe-engines"))
    yield engines
    engines.stop_all()


def complete(
    url: str, model: str, prompt: str | list[int], tokens: int, headers: dict[str, str] | None = None, **body
) -> dict:
    """A greedy ``/v1/completions`` answer of ``tokens`` tokens (EOS ignored, token ids returned) from ``url``."""
    r = httpx.post(
        f"{url}/v1/completions",
        headers=headers,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **body,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return r.json()


def routed_rows(answer: dict) -> np.ndarray:
    """The routing a sidecar returned with ``answer`` (``sglext.routed_experts``): int32 [positions, 2 layers,
    top-2]."""
    routed = answer["sglext"]["routed_experts"]
    assert routed is not None, answer.get("routed_experts_error")
    return np.frombuffer(base64.b64decode(routed), dtype=np.int32).reshape(-1, 2, 2)  # the presets: 2 layers, top-2


def engine_routing(engine: VllmServer, prompt: str, tokens: int) -> tuple[list[int], np.ndarray]:
    """What ``engine`` (the stitchboard extension loaded, no sidecar) routes a marked greedy request
    to, read from its worker: ``(output token ids, int32 [positions, layers, top_k])``."""
    mark = f"stitch-routing-{uuid.uuid4().hex}"
    answer = complete(engine.url, engine.model, prompt, tokens, headers={"x-request-id": mark})
    rpc = httpx.post(
        f"{engine.url}/collective_rpc",
        json={"method": "stitch_routed_experts", "args": [json.dumps({"marks": [mark]})]},
        timeout=60,
    ).json()
    report = rpc["results"][0]["report"]
    capture = report["requests"][mark]
    assert capture["start"] == 0
    rows = np.frombuffer(base64.b64decode(capture["rows"]), dtype=np.int32).reshape(
        -1, report["num_layers"], report["top_k"]
    )
    return answer["choices"][0]["token_ids"], rows
