"""The test tiers and the guard on engine starts (tests/support/tiers.py), checked in pytest subprocesses."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stitchboard.demo.engines import stitchboard_cli
from stitchboard.sidecar.engines.sglang.launch import sglang_command
from stitchboard.sidecar.engines.vllm.launch import FP8_SERVER_MODULE, vllm_command
from tests.support.fork_start import forked_argv
from tests.support.tiers import TIER_FIXTURES, EngineStart, engine_start

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _pytest(args: list[str], cwd: Path, extra_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_engine_starts_are_recognised_however_they_are_made():
    model = Path("/models/none")
    nice = ["nice", "-n", "5"]  # what ManagedProcess puts before an engine's command
    assert engine_start(vllm_command(model, 8000)) == EngineStart("vLLM", 1)
    assert engine_start(nice + forked_argv(vllm_command(model, 8000, tensor_parallel_size=3), "vllm")) == EngineStart(
        "vLLM", 3
    )
    assert engine_start([sys.executable, "-m", FP8_SERVER_MODULE, "--model", "m"]) == EngineStart("vLLM", 1)
    assert engine_start(nice + forked_argv(sglang_command(model, 8000, tp=2), "sglang")) == EngineStart("SGLang", 2)
    assert engine_start(f"{sys.executable} -m sglang.launch_server --tp 2") == EngineStart("SGLang", 2)  # shell=True
    assert engine_start([*stitchboard_cli(), "demo", "--steps", "2"]) == EngineStart("demo")
    for other in ([*stitchboard_cli(), "sidecar", "run"], [*stitchboard_cli(), "pull", "-o", "demo"], ["ls", "-m"]):
        assert engine_start(other) is None, other
    assert EngineStart("vLLM", 1).needs == ("engine",)
    assert EngineStart("SGLang", 2).needs == EngineStart("demo").needs == ("engine", "heavy")


def test_every_registered_fixture_is_defined_where_the_registry_says():
    """A fixture renamed or moved would drop its tests out of their tier: its entry must follow."""
    for key in TIER_FIXTURES:
        file, name = key.split("::")
        tree = ast.parse((ROOT / file).read_text())
        fixtures = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list)
        }
        assert name in fixtures, f"{key}: no fixture {name} in {file}"


def test_every_test_ci_leaves_out_exists_in_the_engine_tier():
    """A renamed or removed test in .ci/engine-left-out.txt would make CI run it again (or hide a typo): each line
    names a module under tests/ or one of its test functions, whose module uses an engine fixture or mark."""
    lines = [ln for ln in (ROOT / ".ci/engine-left-out.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines, ".ci/engine-left-out.txt lists nothing"
    for line in lines:
        file, _, test = line.partition("::")
        assert (ROOT / file).is_file(), f"{line}: no module {file}"
        source = (ROOT / file).read_text()
        tests = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
        name = test.split("[")[0]
        assert not test or name in tests, f"{line}: no test {name} in {file}"
        assert not test or "[" not in test or "parametrize" in source, f"{line}: {name} is not parametrized"
        assert any(f in source for f in ("vllm_", "sglang_", "engine_chain", "moe_engines", "mark.engine")), (
            f"{line}: {file} starts no engine (only engine-tier tests belong in the list)"
        )


def test_the_suites_tests_get_their_tiers_from_their_fixtures(tmp_path: Path, monkeypatch):
    (tmp_path / "tier_dump.py").write_text(
        "import json, os\n"
        "def pytest_collection_finish(session):\n"
        "    tiers = {i.nodeid: sorted({m.name for m in i.iter_markers()} & {'engine', 'heavy', 'slow'}) "
        "for i in session.items}\n"
        "    with open(os.environ['TIER_DUMP'], 'w') as f:\n"
        "        f.write(json.dumps(tiers))\n"
    )  # fmt: skip
    monkeypatch.setenv("TIER_DUMP", str(tmp_path / "tiers.json"))
    modules = ["test_vllm_rebase", "test_vllm_moe", "test_vllm_routing", "test_sglang_gate", "test_vllm_fp8"]
    proc = _pytest(
        ["--collect-only", "-q", "-p", "tier_dump", *(f"tests/sidecar/{m}.py" for m in modules)], ROOT, tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tiers = {
        nodeid.split("/")[-1]: set(marks) for nodeid, marks in json.loads((tmp_path / "tiers.json").read_text()).items()
    }

    def of(prefix: str) -> list[set[str]]:
        found = [marks for nodeid, marks in tiers.items() if nodeid.startswith(prefix)]
        assert found, f"no test {prefix}* collected"
        return found

    # vllm_adapter -> vllm_engine (no mark written in the module); vllm_views -> smollm2_dir
    assert of("test_vllm_rebase.py::") == [{"engine", "slow"}]
    moe = "test_vllm_moe.py::test_moe_patches_through_the_sidecar_equal_a_fresh_engine"
    assert of(f"{moe}[tiny-mixtral-1]") == of(f"{moe}[tiny-qwen3-moe-1]") == [{"engine"}]
    assert of(f"{moe}[tiny-qwen3-moe-2]") == [{"engine", "heavy"}]  # parametrized tp > 1
    assert all(m == set() for m in of("test_vllm_moe.py::test_packing_map") + of("test_vllm_fp8.py::test_unservable"))
    assert all("engine" in m and "heavy" not in m for m in of("test_vllm_routing.py::"))  # routing -> moe_engines
    assert all(m == {"engine", "slow"} for m in of("test_sglang_gate.py::"))  # a module's own fixture: stack


GUARDED = """
import os, subprocess, sys
import pytest
from tests.sidecar.sglang_helpers import SglangServer
from tests.support.vllm_server import VllmServer

SGLANG_TP1 = [sys.executable, "-c", "pass", "-m", "sglang.launch_server", "--tp", "1"]  # exits at once
DEMO = [os.environ["FAKE_STITCHBOARD"], "demo", "--steps", "1"]

def test_unmarked_vllm(tmp_path):
    VllmServer(tmp_path / "no-model", tmp_path / "engine.log").stop()

def test_unmarked_start_caught(tmp_path):
    try:
        SglangServer(tmp_path / "no-model", tmp_path / "engine.log").stop()
    except Exception:
        pass

@pytest.fixture
def engine_from_fixture():
    subprocess.run(SGLANG_TP1, check=True)

def test_unmarked_fixture(engine_from_fixture):
    pass

@pytest.mark.engine
def test_tp2_without_heavy(tmp_path):
    SglangServer(tmp_path / "no-model", tmp_path / "engine.log", tp=2).stop()

@pytest.mark.engine
def test_demo_without_heavy():
    subprocess.run(DEMO, check=True)

@pytest.mark.engine
def test_marked():
    subprocess.run(SGLANG_TP1, check=True)

@pytest.mark.engine
@pytest.mark.heavy
def test_marked_demo():
    subprocess.run(DEMO, check=True)

def test_fast_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_fast_probes_the_host():
    subprocess.run(["uname", "-m"], check=True, capture_output=True)

@pytest.mark.slow
def test_slow_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_engine_and_process_starts_without_their_marks_fail_the_test(tmp_path: Path, monkeypatch):
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    fake = tmp_path / "bin" / "stitchboard"  # `stitchboard demo` as the guard sees it: argv only
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_STITCHBOARD", str(fake))
    proc = _pytest(["-p", "tests.support.tiers", "--strict-markers", "-rA", str(tmp_path)], tmp_path, tmp_path)
    out = proc.stdout + proc.stderr
    outcomes = {m[2]: m[1] for m in re.finditer(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", out, re.MULTILINE)}
    assert outcomes == {
        "test_unmarked_vllm": "FAILED",
        "test_unmarked_start_caught": "FAILED",  # caught by the test: failed all the same
        "test_unmarked_fixture": "ERROR",
        "test_tp2_without_heavy": "FAILED",
        "test_demo_without_heavy": "FAILED",
        "test_marked": "PASSED",
        "test_marked_demo": "PASSED",
        "test_fast_starts_a_process": "FAILED",
        "test_fast_probes_the_host": "PASSED",  # a library's probe (tiers.LIBRARY_PROBES)
        "test_slow_starts_a_process": "PASSED",
    }, out[-6000:]
    for refusal in (
        "test_unmarked_vllm started vLLM TP 1 without the mark(s) engine:",
        "test_unmarked_start_caught started SGLang TP 1 without the mark(s) engine:",
        "test_unmarked_fixture started SGLang TP 1 without the mark(s) engine:",
        "test_tp2_without_heavy started SGLang TP 2 without the mark(s) heavy",
        "test_demo_without_heavy started demo without the mark(s) heavy",
        "test_fast_starts_a_process started a process without the mark slow",
    ):
        assert refusal in out, (refusal, out[-6000:])
    assert "engine starts: 2 (SGLang TP 1 x1, demo x1)" in out  # the refused ones never ran
