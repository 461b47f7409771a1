"""The sidecar (``stitchboard sidecar run --engine sglang``) in front of a real SGLang server on the CPU.

Versions come from real AdamW steps of SmolLM2 published by the trainer SDK
(:class:`vllm_fixtures.VllmRun`: a bulletin on loopback, engine-neutral despite its name); the
sidecar is the real CLI subprocess. One SGLang server (TP = 1, stitchboard's loader) serves the
module; the crash and restart tests start their own. "Verified" means: SGLang's
``weight_version`` is the version, the loader is idle, and every tensor the engine holds has that
version's manifest checksum.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from stitchboard.demo.engines import stitchboard_cli
from stitchboard.proto.decode import read_patch
from stitchboard.sidecar.engines.contract import FAULT_ENV, FAULT_PHASES, FAULT_VERSION_ENV
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from tests.sidecar.sglang_helpers import SglangServer, require_sglang
from tests.sidecar.sidecar_helpers import corrupted
from tests.sidecar.vllm_fixtures import SidecarProcess, VllmRun, copy_model_files

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRun]:
    """The module's run (version 0 published)."""
    require_sglang()
    r = VllmRun(smollm2_dir, tmp_path_factory.mktemp("sglang-run"))
    yield r
    r.close()


@pytest.fixture
def sidecars(run: VllmRun, tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """Factory: ``start(engine_url, **settings)``: a ``--engine sglang`` sidecar subprocess (stopped at teardown)."""
    started: list[SidecarProcess] = []

    def start(engine_url: str, **settings: object) -> SidecarProcess:
        env = {f"STITCH_SIDECAR_{k.upper()}": str(v) for k, v in {"engine": "sglang", **settings}.items()}
        sidecar = SidecarProcess(run, engine_url, tmp_path, env)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()


def assert_verified(engine_url: str, run: VllmRun, version: int, records: Path) -> None:
    """SGLang records ``version``, the loader is idle, and the engine holds exactly its bits."""
    engine = SglangEngine(engine_url, records, timeout_s=60)
    try:
        state = engine.state()
        assert (state.version, state.phase) == (version, "idle")
        sums = run.sums(version)
        assert engine.checksums(sorted(sums)) == sums, f"the engine's weights are not version {version}'s"
    finally:
        engine.close()


def touched(run: VllmRun, version: int) -> set[str]:
    """Checkpoint names the patch files of ``version`` change."""
    names: set[str] = set()
    for f in run.client.manifest(run.run, version).files:
        if f.role == "patch":
            names |= set(read_patch((run.store / "runs" / run.run / "blobs" / f.sha256).read_bytes()).entries)
    return names


def pulled_greedy(run: VllmRun, version: int, model_dir: Path, folder: Path) -> list[dict]:
    """Greedy answers of a fresh plain SGLang started from ``stitchboard pull`` of ``version``."""
    out = folder / f"pulled-v{version}"
    subprocess.run(
        [
            *stitchboard_cli(),
            "pull",
            "--bulletin",
            run.bulletin.url,
            "--run",
            run.run,
            "--version",
            str(version),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    copy_model_files(model_dir, out)
    fresh = SglangServer(out, folder / f"fresh-v{version}.log", loader=False)
    try:
        fresh.wait_ready()
        return fresh.greedy()
    finally:
        fresh.stop()


def test_real_steps_applied_by_the_sidecar_equal_a_fresh_server_bit_for_bit(
    sglang_engine, run, sidecars, smollm2_dir, tmp_path
):
    """The oracle: after two real AdamW steps applied by the sidecar (patches touching q/k/v,
    gate/up and the tied embedding), greedy answers with logprobs, one prompt at a time, equal
    those of a fresh SGLang started from ``stitchboard pull`` of that version, and differ from
    version 0's; requests through the sidecar are stamped with the version."""
    before = sglang_engine.greedy()
    sidecar = sidecars(sglang_engine.url, boot_version=0)
    sidecar.wait_applied(0)
    run.step()
    v = run.step()
    status = sidecar.wait_applied(v)
    assert status["healthy"] and status["last_sync"]["route"] == "delta"
    names = touched(run, v - 1) | touched(run, v)
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "embed_tokens",
    ):
        assert any(part in n for n in names), f"no patch touched {part}"
    records = Path(tmp_path) / "handoff" / f"sidecar-{sidecar.url.rsplit(':', 1)[1]}" / "sglang-records"
    assert_verified(sglang_engine.url, run, v, records)
    patched = sglang_engine.greedy()
    assert patched != before, "version 2 answers like version 0"
    assert patched == pulled_greedy(run, v, smollm2_dir, tmp_path), (
        "the patched engine differs from a fresh engine at the same version"
    )
    answer = httpx.post(
        f"{sidecar.url}/v1/completions",
        json={"model": sglang_engine.model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        timeout=600,
    )
    assert answer.status_code == 200 and answer.headers["X-Stitch-Version-End"] == str(v)


def test_restarted_sidecar_applies_nothing(sglang_engine, run, sidecars):
    """A new sidecar asks SGLang (``weight_version``) what it holds and verifies it: nothing is applied again."""
    first = sidecars(sglang_engine.url, boot_version=0)
    v = run.latest
    first.wait_applied(v)
    first.stop()
    second = sidecars(sglang_engine.url, boot_version=0)  # ignored: the engine records its version
    second.proc.wait_healthy(180)
    status = second.status()
    assert (status["applied_version"], status["state"], status["last_sync"]) == (v, "idle", None)
    assert "stitch_sidecar_commits_total{" not in second.metrics()
    assert "engine at version" not in second.log_tail(100_000)


def test_two_sidecars_on_one_engine_only_the_lease_holder_changes_it(sglang_engine, run, sidecars, tmp_path):
    """Issue #27 part B on a real SGLang server. Of two sidecars on one engine exactly one holds the
    lease (through the loader's control socket: the other makes no update call at all, its
    records folder stays empty): the other answers /health 503 ``standby`` naming the holder and
    commits nothing while the holder commits a real step. Killed (-9: nothing released), the
    holder's lease lapses after the TTL and the other takes the engine over with no manual step
    (SGLang's version checked against the manifest, nothing applied again), then syncs bit-exact."""
    first = sidecars(sglang_engine.url, boot_version=0)
    first.wait_applied(run.latest)
    holder = first.lease()
    assert holder["held"] and holder["holder"] == holder["owner"]
    second = sidecars(sglang_engine.url, boot_version=0)
    body = second.wait_standby(holder["owner"])
    assert body["applied_version"] is None and 0 < body["lease"]["holder_expires_in_s"] <= 5.0
    assert f'holder="{holder["owner"]}"' in second.metrics()
    quiet = tmp_path / "handoff" / f"sidecar-{second.url.rsplit(':', 1)[1]}" / "sglang-records"
    assert not quiet.exists() or not any(quiet.iterdir()), "the sidecar without the lease made an update call"

    v = run.step()
    first.wait_applied(v)
    records = tmp_path / "handoff" / f"sidecar-{first.url.rsplit(':', 1)[1]}" / "sglang-records"
    assert_verified(sglang_engine.url, run, v, records)
    status = second.status()
    assert (status["applied_version"], status["last_sync"]) == (None, None)
    assert "stitch_sidecar_commits_total{" not in second.metrics()
    assert not quiet.exists() or not any(quiet.iterdir())

    os.kill(first.proc.proc.pid, signal.SIGKILL)
    first.proc.proc.wait(30)
    taken = second.wait_applied(v)  # once the killed sidecar's lease lapsed
    assert taken["last_sync"] is None, "the engine's version was applied again on takeover"
    assert second.lease()["held"]
    v = run.step()
    second.wait_applied(v)
    assert_verified(sglang_engine.url, run, v, quiet)


def test_corrupted_file_is_refused_before_the_engine_is_touched(sglang_engine, run, sidecars):
    """Wrong bytes stored under a patch's sha256: the fetch refuses them, SGLang is never paused and
    keeps its version; once the store is repaired the sidecar gets through on its own."""
    first = sidecars(sglang_engine.url, boot_version=0)
    v = run.latest
    first.wait_applied(v)
    first.stop()
    # The prompts answered once first: a prompt prefilled in full and one whose prefix SGLang's
    # radix cache holds can differ in a logprob's last bits, so both answers compared come from the cache.
    sglang_engine.greedy()
    before = sglang_engine.greedy()
    assert run.step() == v + 1
    (patch,) = [f for f in run.client.manifest(run.run, v + 1).files if f.role == "patch"]
    blob = run.store / "runs" / run.run / "blobs" / patch.sha256
    with corrupted(blob):  # put back when the block ends: the module's next tests need version v + 1
        sidecar = sidecars(sglang_engine.url)
        status = sidecar.wait_status(
            lambda s: (s["last_error"] or {}).get("type") == "BlobMismatch", "the checksum mismatch reported"
        )
        assert (status["applied_version"], status["target_version"]) == (v, v + 1)
        assert not re.search(r"stitch_sidecar_pause_seconds_count\{route=\"\w+\"\} [1-9]", sidecar.metrics()), (
            "the engine was paused"
        )
        assert sglang_engine.greedy() == before
    sidecar.wait_applied(v + 1)


class EngineChain:
    """Fresh SGLang servers from the checkpoint (version 0) for the crash tests, one at a time; the
    server started to recover from one crash is armed for the next test's phase (N phases, N + 1 starts)."""

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.server: SglangServer | None = None
        self.armed: tuple[str | None, int] | None = None

    def start(self, phase: str | None, version: int, port: int | None = None) -> SglangServer:
        self.stop()
        env = {FAULT_ENV: phase, FAULT_VERSION_ENV: str(version)} if phase else {}
        self.server = SglangServer(
            self.model_dir,
            self.logs / f"engine-{phase}-v{version}-{len(os.listdir(self.logs))}.log",
            env=env,
            port=port,
        )
        self.armed = (phase, version)
        self.server.wait_ready()
        return self.server

    def armed_for(self, phase: str, version: int) -> SglangServer:
        return self.server if self.server is not None and self.armed == (phase, version) else self.start(phase, version)

    def unarmed(self) -> SglangServer:
        """The current server if it is not armed to die, else a fresh unarmed one."""
        if self.server is not None and self.armed is not None and self.armed[0] is None:
            return self.server
        return self.start(None, 0)

    def kill_and_restart(self) -> SglangServer:
        """SIGKILL the server's process group and start the same command on the same port."""
        assert self.server is not None
        old = self.server
        os.killpg(old.proc.pid, signal.SIGKILL)
        old.proc.wait(60)
        old.stop()
        return self.start(None, 0, port=old.port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def engine_chain(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineChain]:
    require_sglang()
    chain = EngineChain(smollm2_dir, tmp_path_factory.mktemp("sglang-chain"))
    yield chain
    chain.stop()


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_engine_killed_mid_apply_ends_at_a_verified_version(phase, engine_chain, run, sidecars, tmp_path):
    """SGLang dies at ``phase`` of an apply (its scheduler exits; the server goes down); the sidecar
    claims no version while it is down; restarted from its checkpoint, with a new sidecar, the
    engine ends verified at the target."""
    v = run.latest + 1
    engine = engine_chain.armed_for(phase, v)
    first = sidecars(engine.url, boot_version=0)
    first.wait_applied(v - 1)
    assert run.step() == v
    status = first.wait_status(lambda s: s["applied_version"] is None, "no version claimed while the engine is down")
    assert not status["healthy"]
    assert f"exiting at phase {phase} of version {v - 1}->{v}" in engine.log_tail(2_000_000)
    first.stop()
    following = FAULT_PHASES.index(phase) + 1
    engine = engine_chain.start(FAULT_PHASES[following] if following < len(FAULT_PHASES) else None, v + 1)
    second = sidecars(engine.url, boot_version=0)
    assert second.wait_applied(v)["healthy"]
    records = tmp_path / "handoff" / f"sidecar-{second.url.rsplit(':', 1)[1]}" / "sglang-records"
    assert_verified(engine.url, run, v, records)


def test_engine_restarted_under_a_running_sidecar_is_never_served_under_the_old_version(
    engine_chain, run, sidecars, tmp_path
):
    """SGLang is killed (-9) and started again on the same port from its checkpoint while a sidecar
    claims version v: a request pinned to v is answered only once the engine holds v again, the
    same answer, bit for bit, as before the restart."""
    engine = engine_chain.unarmed()
    first = sidecars(engine.url, boot_version=0)
    v = run.latest
    first.wait_applied(v)
    headers = {"X-Stitch-Exact-Version": str(v), "X-Stitch-Wait-S": "300"}
    body = {
        "model": engine.model,
        "prompt": "Once upon a time, in a small village by the sea,",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 5,
    }

    def pinned() -> dict:
        answer = httpx.post(f"{first.url}/v1/completions", json=body, headers=headers, timeout=600)
        assert answer.status_code == 200, answer.text
        assert (answer.json()["weight_version_start"], answer.json()["weight_version_end"]) == (v, v)
        return answer.json()["choices"][0]

    before = pinned()
    engine = engine_chain.kill_and_restart()
    assert pinned() == before, "answered by other weights than version v's"
    first.wait_applied(v)
    assert "stitch_sidecar_claims_dropped_total 1.0" in first.metrics()
    records = tmp_path / "handoff" / f"sidecar-{first.url.rsplit(':', 1)[1]}" / "sglang-records"
    assert_verified(engine.url, run, v, records)
