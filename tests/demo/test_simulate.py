"""The fleet model (demo/simulate): tiny cases computed by hand, the store's throttling with the client's backoff,
the command's files and summary line, and the validation against a real bulletin at its smallest scale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import simpy
from typer.testing import CliRunner

from stitchboard.demo.simulate.cli import simulate
from stitchboard.demo.simulate.figures import Fleet
from stitchboard.demo.simulate.host import Host
from stitchboard.demo.simulate.model import Scenario, StepModel, StepResult
from stitchboard.demo.simulate.validate import simulated, validate

INF = float("inf")


def tiny(**values: float) -> Fleet:
    """2 replicas in 1 region, 2 files of 100 bytes, one bulletin process taking 0.5 s a request, the store
    streaming 100 B/s per request, nothing else costing time."""
    base = {
        "parameters": 200, "changed_fraction": 1.0, "bytes_per_changed_cond": 1.0, "trainer_ranks": 2,
        "replicas": 2, "regions": 1, "bulletin_processes": 1, "poll_answer_s": 0.0, "control_requests": 0,
        "bulletin_request_s": 0.5, "store_get_rate": INF, "store_stream_Bps": 100.0, "origin_Bps": INF,
        "single_flow_Bps": 100.0, "relay_egress_Bps": INF, "fetch_concurrency": 1, "verify_Bps": INF,
        "decode_cond_per_s": INF, "pause_fixed_s": 0.0, "pause_s_per_element": 0.0,
    }  # fmt: skip
    return Fleet().with_values(**{**base, **values})


def test_origin_only_by_hand() -> None:
    # r0: ask 0-0.5, file 0.5-1.5, ask 1.5-2.0, file 2.0-3.0; r1: ask 0.5-1.0 (queued), file 1.0-2.0,
    # ask 2.0-2.5 (behind r0's), file 2.5-3.5.
    r = StepModel(Scenario(tiny(), cache=False)).run()
    assert r.at_version_s == pytest.approx([3.0, 3.5])
    assert (r.store_gets, r.store_slowdowns, r.bulletin_requests, r.origin_egress_bytes) == (4, 0, 4, 400)
    assert r.time_to(0.5) == pytest.approx(3.0) and r.time_to(1.0) == pytest.approx(3.5)


def test_cache_tier_fills_each_blob_once_by_hand() -> None:
    # The relay asks the bulletin (0.5 s each, in turn) and fetches each blob once (1 s); both replicas wait on
    # the fill, then get the blob from the relay at 100 B/s each: file 0 at 0.5 + 1 + 1 = 2.5; file 1 filled at
    # 2.5 + 0.5 + 1 = 4.0 (its fill starts at the first ask, 2.5), served by 5.0.
    r = StepModel(Scenario(tiny(), cache=True)).run()
    assert r.at_version_s == pytest.approx([5.0, 5.0])
    assert (r.store_gets, r.bulletin_requests, r.origin_egress_bytes) == (2, 2, 200)
    # a relay that coalesced misses into 2 origin GETs a blob (bench_relay measures 1.00) doubles the origin's share
    r2 = StepModel(Scenario(tiny(relay_origin_gets_per_blob=2.0), cache=True)).run()
    assert (r2.store_gets, r2.origin_egress_bytes) == (4, 400)


def test_apply_time_by_hand() -> None:
    fleet = Fleet().with_values(
        parameters=1e6, changed_fraction=0.5, engine_ranks=2, decode_cond_per_s=1e5, pause_fixed_s=0.1,
        pause_s_per_element=1e-6,
    )  # fmt: skip
    assert fleet.apply_s("cond") == pytest.approx((2.5, 0.35))
    assert fleet.version_bytes("xor") == pytest.approx(5e5 * fleet.bytes_per_changed_xor.value)


def test_host_shares_its_core_between_processes_and_among_a_process_jobs_by_hand() -> None:
    # One core: the bulletin's 1 s job and two fetcher jobs of 1 s. Bulletin and fetchers get half a core each,
    # each fetcher job a quarter: at 2 s the bulletin is done and each fetcher job has 0.5 s left; alone, they run
    # at half a core each.
    env = simpy.Environment()
    host = Host(env, cores=1)
    done: dict[str, float] = {}

    def job(process: str, name: str, cpu_s: float, at_s: float = 0.0) -> simpy.events.ProcessGenerator:
        yield env.timeout(at_s)
        yield host.work(process, cpu_s)
        done[name] = env.now

    env.process(job("bulletin", "b", 1.0))
    env.process(job("replicas", "f1", 1.0))
    env.process(job("replicas", "f2", 1.0))
    env.process(job("replicas", "late", 0.25, at_s=2.5))  # joins at 2.5: three jobs at 1/3 core each
    env.process(job("replicas", "free", 0.0))
    env.run()
    assert done["free"] == 0.0 and done["b"] == pytest.approx(2.0)
    # at 2.5 f1 and f2 have 0.25 s left; with "late" all three run at 1/3 core: all done at 3.25
    assert [done[n] for n in ("f1", "f2", "late")] == pytest.approx([3.25, 3.25, 3.25])


def test_host_gives_a_process_at_most_one_core() -> None:
    env = simpy.Environment()
    host = Host(env, cores=2)
    ends: list[float] = []

    def job(process: str) -> simpy.events.ProcessGenerator:
        yield host.work(process, 1.0)
        ends.append(env.now)

    for process in ("a", "b", "b"):
        env.process(job(process))
    env.run()
    assert ends == pytest.approx([1.0, 2.0, 2.0])  # a alone on a core; b's two jobs share the other
    with pytest.raises(ValueError, match="positive number of cores"):
        Host(env, cores=0)


def test_validation_model_by_hand() -> None:
    # 2 fetchers x 1 blob; the bulletin spends 1 s a GET, a fetcher 1 s a blob, one core. The bulletin answers A
    # (0-1, alone); then A's check and B's answer share the core (1-3); then B's check alone (3-4). A pipe that
    # ran each blob's 2 s whole, one after another, would say [2, 4].
    r = simulated(2, 1, 100, server_s=1.0, client_s=1.0)
    assert r.at_version_s == pytest.approx([3.0, 4.0])
    # the lone fetcher's wall time, longer than both CPU figures together, stretches both
    assert simulated(2, 1, 100, server_s=1.0, client_s=1.0, wall_s=4.0).at_version_s == pytest.approx([6.0, 8.0])


def test_throttled_store_answers_slowdown_and_every_replica_gets_there() -> None:
    # 40 replicas at once against 10 GETs/s: the first second's burst is admitted, the rest 503 and back off with
    # the client's jitter; syncs whose retries run out are retried by the sidecar; every replica ends at vN.
    fleet = tiny(replicas=40, trainer_ranks=1, parameters=100, store_get_rate=10.0, bulletin_request_s=0.0)
    r = StepModel(Scenario(fleet, cache=False, seed=3)).run()
    assert len(r.at_version_s) == 40 and r.store_gets == 40
    assert r.store_slowdowns > 30 and r.failed_syncs > 0
    assert r.time_to(1.0) >= (40 - 10) / 10.0  # no faster than the rate allows


def test_peak_retry_rate_counts_the_densest_window() -> None:
    r = StepResult(Scenario(tiny()), store_retries_s=[0.01, 0.02, 0.05, 0.5, 0.55])
    assert r.peak_retry_rate(0.1) == pytest.approx(30.0)
    assert StepResult(Scenario(tiny())).peak_retry_rate() == 0.0


def test_command_writes_its_files_and_summary_line(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--parameters", "1e9", "--replicas", "30", "--fetchers", "0"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert re.fullmatch(
        r"simulate: t50_s=[\d.]+ t99_s=[\d.]+ t100_s=[\d.]+ origin_egress_gb=[\d.]+ validation_ratio=skipped", last
    )
    assert (tmp_path / "replicas_at_version.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "simulate.md").read_text()
    assert "| cond, cache tier |" in text and "| public |" in text and "| measured |" in text


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
def test_validation_against_a_real_bulletin() -> None:
    # The smallest meaningful scale: 50 fetchers, one round. The slow tier runs on 2 cores beside other xdist
    # workers and jobs (three copies of this test at once read as low as 0.49), so this bound is 3x: it catches a broken
    # model (a unit off, a cost left out) while the 25 % claim is held by the full run in docs/scale.md.
    v = validate(fetchers=50, blobs=2, blob_bytes=1 << 20, solo_rounds=20, repeats=1)
    assert v.server_s_per_get > 0 and v.client_s_per_get > 0 and v.wall_s_per_get > 0
    assert v.measured_t50_s <= v.measured_t100_s and v.simulated_t50_s <= v.simulated_t100_s
    assert 1 / 3 <= v.ratio <= 3.0, v


def _app():  # type: ignore[no-untyped-def]
    import typer

    app = typer.Typer()
    app.command()(simulate)
    return app
