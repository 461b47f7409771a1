"""Fixtures of the real-vLLM tests (imported by this folder's conftest.py).

One vLLM server with the stitchboard worker extension serves the SmolLM2 checkpoint for the
whole session (start-up 45 s-3 min on 2 cores); tests bring it to the version they need by
loading a snapshot (~1 s) rather than restarting it. Real weight updates come from
:class:`tests.support.training.CpuTrainer` (two AdamW steps, ~10 s).

The sidecar tests (test_sidecar_vllm.py) add :class:`VllmRun`, a bulletin on loopback whose run
the trainer SDK publishes from real AdamW steps, and ``stitchboard sidecar run`` subprocesses
(:class:`SidecarProcess`) in front of an engine.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.sidecar_wire import COMMIT_STATES
from tests.support import lease
from tests.support.vllm_server import VllmServer, require_vllm

Views = dict[int, dict[str, RawTensor]]


def copy_model_files(model_dir: Path, folder: Path) -> None:
    """Copy a checkpoint folder's config and tokenizer files (everything but the weights)."""
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, folder / f.name)


def view_sums(view: dict[str, RawTensor]) -> dict[str, str]:
    """name -> xxh3-128 of every tensor of a view."""
    return {n: checksum(t) for n, t in view.items()}


#: SmolLM2-135M's linear layers (N, K) and how many it has of each: qkv, o, gate_up, down per layer, the tied head.
SMOLLM2_LINEARS = {(960, 576): 30, (576, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 1}


def dispatched_linear(shape: tuple[int, int]) -> tuple[types.SimpleNamespace, bool]:
    """vLLM's CPU GEMM dispatch run here on a bf16 weight of ``shape`` (N, K): the layer it gives, and whether that
    layer holds a copy of the weight (after the weight is overwritten in place it still answers with the old one;
    otherwise it must answer with the new one)."""
    import torch
    from vllm.model_executor.layers import utils

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, dtype=torch.bfloat16, generator=generator)
    x = torch.randn(4, shape[1], dtype=torch.bfloat16, generator=generator)
    layer = types.SimpleNamespace(weight=weight, bias=None)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    before = layer.cpu_linear(x, weight, None).clone()
    weight.copy_(torch.randn(shape, dtype=torch.bfloat16, generator=generator))  # written in place, as a patch writes
    after = layer.cpu_linear(x, weight, None)
    reads_live = torch.equal(after, torch.nn.functional.linear(x, weight, None))
    holds_old = torch.equal(after, before)
    assert reads_live != holds_old, f"the {shape} layer answered with neither the old nor the new weight"
    return layer, holds_old


@functools.cache
def _smollm2_gemm_copies() -> int:
    """How many SmolLM2 linears hold a GEMM copy of their weight on this host (:func:`dispatched_linear`)."""
    return sum(layers * dispatched_linear(shape)[1] for shape, layers in SMOLLM2_LINEARS.items())


def assert_repacked(repacked_modules: int) -> None:
    """An engine's report of a SmolLM2 update touching every linear re-packed the linears holding a GEMM copy on this
    host: none where bf16 has no packed kernel (no AVX-512 BF16), else at least one per such linear (the tied
    embedding may hold one of its own beside the head's)."""
    copies = _smollm2_gemm_copies()
    assert repacked_modules >= copies if copies else repacked_modules == 0, (repacked_modules, copies)


@pytest.fixture(scope="session")
def vllm_views(smollm2_dir: Path) -> Views:
    """Served views of versions 0, 1, 2: the checkpoint, then after each of two real AdamW steps."""
    require_vllm()
    import torch

    from tests.support.training import CpuTrainer

    def raw(view: dict) -> dict[str, RawTensor]:
        return {
            n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
            for n, t in view.items()
        }

    trainer = CpuTrainer(smollm2_dir)
    views = {0: raw(trainer.served_view())}
    for v in (1, 2):
        trainer.step()
        views[v] = raw(trainer.served_view())
    return views


@pytest.fixture(scope="session")
def vllm_workdir() -> Iterator[Path]:
    """A session folder on memory-backed storage when there is one (the sidecar's hand-off folder)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix="stitch-vllm-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_engine(smollm2_dir: Path, vllm_workdir: Path) -> Iterator[VllmServer]:
    """The session's vLLM server (extension loaded) booted from the SmolLM2 checkpoint (version 0)."""
    require_vllm()
    server = VllmServer(smollm2_dir, vllm_workdir / "engine.log")
    try:
        server.wait_ready()
        server.boot_greedy = server.greedy()  # answers of a freshly loaded version 0
        yield server
    finally:
        server.stop()


@pytest.fixture
def vllm_adapter(vllm_engine: VllmServer):
    """A :class:`VllmEngine` adapter on the session engine, holding the engine's lease (released after)."""
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    engine = VllmEngine(vllm_engine.url, timeout_s=30)
    with lease.holding(engine):
        yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_snapshot(vllm_views: Views, vllm_workdir: Path) -> Callable[[int], list[str]]:
    """``snapshot(v)``: shard paths of version ``v``'s full checkpoint in the hand-off folder (written once)."""

    def snapshot(version: int) -> list[str]:
        folder = vllm_workdir / f"snapshot-v{version}"
        if not folder.exists():
            save_checkpoint(folder, vllm_views[version], max_shard_bytes=128 * 1024**2)
        return sorted(str(p) for p in folder.glob("*.safetensors"))

    return snapshot


@pytest.fixture(scope="session")
def vllm_fresh_greedy(smollm2_dir: Path, vllm_views: Views, vllm_workdir: Path) -> Callable[[int], list[dict]]:
    """``fresh(v)``: greedy answers of a fresh plain vLLM started from version ``v``'s full checkpoint (cached)."""
    answers: dict[int, list[dict]] = {}

    def fresh(version: int) -> list[dict]:
        if version not in answers:
            folder = vllm_workdir / f"checkpoint-v{version}"
            save_checkpoint(folder, vllm_views[version])
            copy_model_files(smollm2_dir, folder)
            server = VllmServer(folder, vllm_workdir / f"fresh-v{version}.log", extension=False)
            try:
                server.wait_ready()
                answers[version] = server.greedy()
            finally:
                server.stop()
        return answers[version]

    return fresh


# --- the sidecar in front of real vLLM (test_sidecar_vllm.py) ---------------------------------


class VllmRun:
    """A bulletin on loopback and one run on it, published by the trainer SDK from real AdamW steps.

    Version 0 is the SmolLM2 checkpoint's bits (its float32 master cast back to bf16); each
    :meth:`step` trains one step of :class:`support.training.CpuTrainer` and publishes it. The
    batch is one row of 32 tokens: AdamW still moves ~1 % of the served bits per step, and the
    step costs little more than the optimizer's pass over the weights.

    Args:
        model_dir: the SmolLM2 checkpoint folder.
        folder: where the bulletin's store and the publisher's work files go.
        publisher_options: extra keyword arguments of the :class:`Publisher` (``part_bytes``, ``encoding``...).
    """

    def __init__(self, model_dir: Path, folder: Path, **publisher_options: object) -> None:
        from stitchboard.bulletin.app import create_app as create_bulletin
        from stitchboard.bulletin.settings import BulletinSettings
        from stitchboard.trainer_client.publisher import Publisher
        from tests.sidecar.commit_overlap import LatchedClient
        from tests.sidecar.sidecar_helpers import AppServer
        from tests.support.training import CpuTrainer

        self.run = "vllm-sidecar"
        self.store = folder / "store"
        self.bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{self.store}", poll_interval_s=0.05)))
        self.client = LatchedClient(self.bulletin.url, retries=1, backoff_s=0.05)
        self.trainer = CpuTrainer(model_dir, batch_size=1, seq_len=32)
        self.publisher = Publisher(
            self.bulletin.url, self.run, client=self.client, workdir=folder / "publisher", **publisher_options
        )
        self.publisher.publish(self.trainer.model, step=0)

    @property
    def latest(self) -> int:
        """The last published version."""
        return self.publisher.last_version

    def train(self) -> None:
        """One AdamW step (not yet published)."""
        self.trainer.step()

    def publish(self) -> int:
        """Publish the trainer's weights as the next version; returns it."""
        return self.publisher.publish(self.trainer.model, step=self.trainer.steps).version

    def publish_held(self):
        """Start publishing the trainer's weights in a thread that stops before the commit
        (a :class:`commit_overlap.HeldPublish`: ``wait_ready()``, then ``commit()``)."""
        from tests.sidecar.commit_overlap import HeldPublish

        return HeldPublish(self.client, self.publish)

    def step(self) -> int:
        """Train one step and publish it; returns the new version."""
        self.train()
        return self.publish()

    def sums(self, version: int) -> dict[str, str]:
        """name -> xxh3-128 of every tensor of ``version``, from its manifest."""
        return self.client.manifest(self.run, version).checksums()

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
        self.bulletin.stop()


def load_checkpoint_as_version_0(engine_url: str, model_dir: Path, sums: dict[str, str]) -> None:
    """Make an engine hold the SmolLM2 checkpoint as version 0 (whatever it held), resumed."""
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    engine = VllmEngine(engine_url, timeout_s=60)
    try:
        with lease.holding(engine, "version-0"):
            engine.pause()
            try:
                engine.load_snapshot([str(model_dir / "model.safetensors")], 0, sums)
                engine.reset_prefix_cache()
            finally:
                engine.resume()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm_run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRun]:
    """The module's run, version 0 published."""
    require_vllm()
    run = VllmRun(smollm2_dir, tmp_path_factory.mktemp("vllm-run"))
    yield run
    run.close()


@pytest.fixture(scope="module")
def vllm_run_engine(vllm_engine: VllmServer, vllm_run: VllmRun, smollm2_dir: Path) -> Iterator[VllmServer]:
    """The session engine, holding the module run's version 0 at first (and again afterwards)."""
    load_checkpoint_as_version_0(vllm_engine.url, smollm2_dir, vllm_run.sums(0))
    yield vllm_engine
    load_checkpoint_as_version_0(vllm_engine.url, smollm2_dir, vllm_run.sums(0))  # what test_vllm_engine.py expects


class SidecarProcess:
    """A ``stitchboard sidecar run`` subprocess following :class:`VllmRun`'s run for one engine.

    Args:
        run: the run to follow.
        engine_url: the engine's base URL.
        folder: where its log (``sidecar-<port>.log``) and hand-off folder go.
        env: extra ``STITCH_SIDECAR_*`` settings (e.g. ``STITCH_SIDECAR_BOOT_VERSION``).
    """

    def __init__(self, run: VllmRun, engine_url: str, folder: Path, env: dict[str, str]) -> None:
        from stitchboard.demo.engines import stitchboard_cli
        from stitchboard.demo.processes import ManagedProcess, free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        settings = {
            "BULLETIN": run.bulletin.url, "RUN": run.run, "ENGINE_URL": engine_url, "PORT": str(port),
            "HANDOFF_DIR": str(folder / "handoff"),
            "POLL_WAIT_S": "5", "RETRY_BACKOFF_S": "0.2", "MAX_BACKOFF_S": "1", "BULLETIN_RETRIES": "1",
            "LOG_LEVEL": "info",
        }  # fmt: skip
        full_env = {**{f"STITCH_SIDECAR_{k}": v for k, v in settings.items()}, **env}
        self.proc = ManagedProcess(
            f"sidecar-{port}",
            [*stitchboard_cli(), "sidecar", "run"],
            folder / f"sidecar-{port}.log",
            f"{self.url}/health",
            full_env,
        )
        # One client for every poll: a one-off httpx.get builds a client and its SSL context per request (30-40 ms
        # of CPU against ~2 ms, measured on the CI's 2-core host); at ten status polls a second that took a third
        # of a core from the engine staging the version a benchmark times.
        self._http = httpx.Client(base_url=self.url, timeout=30)

    def status(self) -> dict:
        """``GET /v1/stitch/status``."""
        return self._http.get("/v1/stitch/status").json()

    def metrics(self) -> str:
        """The sidecar's Prometheus metrics text."""
        return self._http.get("/metrics").text

    def lease(self) -> dict:
        """The ``lease`` part of ``GET /health``: ``owner``, ``held``, ``holder``, ``holder_expires_in_s``."""
        return self._http.get("/health").json()["lease"]

    def wait_standby(self, holder: str, timeout_s: float = 120.0) -> dict:
        """Wait until ``/health`` answers 503 ``standby`` naming ``holder`` (another sidecar holds
        the engine's lease); returns that body."""
        seen: dict = {}

        def standby(_: dict) -> bool:
            r = self._http.get("/health")
            if r.status_code == 503 and r.json().get("status") == "standby":
                seen.update(r.json())
            return bool(seen)

        self.wait_status(standby, f"standby naming {holder}", timeout_s)
        assert seen["lease"]["holder"] == holder and holder in seen["reason"], seen
        return seen

    def wait_status(self, predicate: Callable[[dict], bool], what: str, timeout_s: float = 300.0) -> dict:
        """Poll the status until ``predicate(status)``; returns it. Fails after ``timeout_s`` or if the process
        exits."""
        deadline = time.monotonic() + timeout_s
        status: dict = {}
        while time.monotonic() < deadline:
            if self.proc.proc.poll() is not None:
                raise AssertionError(
                    f"sidecar exited ({self.proc.proc.returncode}) waiting for {what}:\n{self.log_tail()}"
                )
            try:
                status = self.status()
                if predicate(status):
                    return status
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; status {status}\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        """The log's last ``lines`` lines, without the access lines of status polls (which flood it)."""
        kept = [
            line
            for line in self.proc.log_path.read_text(errors="replace").splitlines()
            if "/v1/stitch/status" not in line
        ]
        return "\n".join(kept[-lines:])

    def wait_applied(self, version: int, timeout_s: float = 300.0) -> dict:
        """Wait until the sidecar reports ``version`` applied and its commit finished (the engine
        resumed: the version is marked applied just before the resume); returns the status."""
        return self.wait_status(
            lambda s: s["applied_version"] == version and s["state"] not in COMMIT_STATES,
            f"version {version} applied",
            timeout_s,
        )

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 20 s) unless it already exited."""
        self.proc.stop()
        self._http.close()


@pytest.fixture
def vllm_sidecars(vllm_run: VllmRun, tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """Factory: ``start(engine_url, **settings)`` starts a sidecar subprocess (settings: lower-case
    ``SidecarSettings`` fields, e.g. ``boot_version=0``); every one is stopped at teardown."""
    started: list[SidecarProcess] = []

    def start(engine_url: str, **settings: object) -> SidecarProcess:
        sidecar = SidecarProcess(
            vllm_run, engine_url, tmp_path, {f"STITCH_SIDECAR_{k.upper()}": str(v) for k, v in settings.items()}
        )
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()
