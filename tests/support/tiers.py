"""The test tiers (marks ``engine``, ``heavy``, ``slow``) and the guard on process starts: a pytest plugin.

Runs in the pytest process (``tests/conftest.py`` loads it); docs/testing.md describes the tiers.

Classification, at collection (:func:`pytest_collection_modifyitems`): a test gets the marks of
every fixture in its fixture closure (``item.fixturenames``: the fixtures it requests and, in
turn, theirs) that :data:`TIER_FIXTURES` lists, so a new test that asks for the session's vLLM
engine, or for any fixture built on it, is an ``engine`` test without saying so. A test
parametrized with ``tp`` > 1 is ``heavy``. Tests that start an engine in their own body carry
the mark themselves.

The guard (:func:`engine_start`, a :func:`sys.addaudithook` on ``subprocess.Popen``, the one call
every process start goes through: the server helpers, the demo's process starter, the CLI): a
vLLM or SGLang server, or ``stitchboard demo``, started by a test without the ``engine`` mark
(or, with TP > 1 or for the demo, without ``heavy``) is refused before it runs
(:class:`UnmarkedEngineStart`); any other process started by a test with neither ``slow`` nor
``engine`` is refused too (:class:`UnmarkedProcessStart`: the fast tier runs in its workers'
processes only). The test fails even if it caught the error. The engine starts seen are summed
up at the end of the session (kind, TP, count). ``multiprocessing`` starts (torch.distributed
ranks) raise no audit event: the modules that spawn ranks carry ``slow`` themselves.
"""

from __future__ import annotations

import collections
import inspect
import os
import shlex
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from stitchboard.sidecar.engines.vllm.launch import FP8_SERVER_MODULE
from tests.support.fork_start import MODULES

#: A ``subprocess.Popen`` command, as the audit event passes it.
Argv = str | bytes | os.PathLike | Sequence[str | bytes | os.PathLike]

#: Fixtures that put every test whose closure holds them in a tier: ``"<file>::<fixture name>"``
#: (the file defining the fixture function, from the repository root) -> the marks. ``engine``:
#: the fixture starts or holds a real vLLM/SGLang server; ``heavy``: one of the costliest
#: oracles; ``slow``: needs the SmolLM2 checkpoint (built once, ~25 s) or starts processes.
TIER_FIXTURES: dict[str, tuple[str, ...]] = {
    "tests/conftest.py::smollm2_dir": ("slow",),
    # a real S3 server (Ceph radosgw: monitor, OSD and gateway processes)
    "tests/support/radosgw.py::radosgw": ("slow",),
    # the session's vLLM (TP 1, extension, SmolLM2), and every fixture built on it (vllm_adapter, vllm_run_engine)
    "tests/sidecar/vllm_fixtures.py::vllm_engine": ("engine",),
    # fresh plain vLLM engines of versions 0-2 of SmolLM2 (the bit-exact oracle)
    "tests/sidecar/vllm_fixtures.py::vllm_fresh_greedy": ("engine",),
    # the session's vLLM servers on the tiny MoE presets (TP 1 or 2)
    "tests/sidecar/moe_fixtures.py::moe_engines": ("engine",),
    # the SGLang server (TP 1, loader, SmolLM2) shared by the SGLang modules
    "tests/sidecar/sglang_helpers.py::sglang_engine": ("engine",),
    # fresh vLLM / SGLang servers armed to die mid-apply (the crash tests)
    "tests/sidecar/test_sidecar_vllm.py::engine_chain": ("engine",),
    "tests/sidecar/test_sglang_sidecar.py::engine_chain": ("engine",),
    # the vLLM server with --enable-lora (2 adapter slots) of the LoRA engine tests
    "tests/sidecar/test_vllm_lora.py::lora_engine": ("engine",),
    # the vLLM server with --enable-lora (3 adapter slots: K = 2 resident + 1) under a sidecar in adapter mode
    "tests/sidecar/test_vllm_adapter_sidecar.py::adapter_engine": ("engine",),
    # the shared SGLang server, a sidecar and a fresh plain SGLang (the gate's oracle)
    "tests/sidecar/test_sglang_gate.py::stack": ("engine",),
}
#: The marks of the tiers, registered by :func:`pytest_configure` (``--strict-markers`` refuses any other).
TIER_MARKS = {
    "engine": "starts or uses a real vLLM or SGLang server, or runs the demo (set from the fixtures in TIER_FIXTURES)",
    "heavy": "one of the costliest oracles: an engine at TP > 1, the demo (`make test-heavy` runs them)",
    "slow": (
        "trains SmolLM2 (set from the smollm2_dir fixture) or with a framework's trainer, or starts processes of its "
        "own: servers, CLIs, trainer ranks, a browser, a wheel build (`make test-slow` runs those without engines)"
    ),
}


class UnmarkedEngineStart(RuntimeError):
    """A test started an engine (or the demo) without the tier mark that start needs.

    Mark the test (``@pytest.mark.engine``, and ``heavy`` for TP > 1 or the demo), or start the
    engine from a fixture listed in :data:`TIER_FIXTURES` (adding it there if it is new).
    """


class UnmarkedProcessStart(RuntimeError):
    """A test of the fast tier (neither ``slow`` nor ``engine``) started a process.

    The fast tier runs in its workers' processes only (servers on loopback threads). Mark the test
    (or its module: ``pytestmark = pytest.mark.slow``) ``slow``, or start the process from a fixture
    listed in :data:`TIER_FIXTURES` with ``slow``.
    """


@dataclass(frozen=True)
class EngineStart:
    """What one process start is: ``kind`` ``vLLM``, ``SGLang`` or ``demo``; ``tp`` its tensor-parallel size."""

    kind: str
    tp: int = 1

    @property
    def needs(self) -> tuple[str, ...]:
        """The marks a test starting it must carry."""
        return ("engine", "heavy") if self.kind == "demo" or self.tp > 1 else ("engine",)

    def __str__(self) -> str:
        return self.kind if self.kind == "demo" else f"{self.kind} TP {self.tp}"


#: Programs libraries start to probe the host, not processes a test starts: ``file`` (``platform.architecture``,
#: which TRL and vLLM imports call), a compiler's ``--version`` (torch's C++ builder), ``ldconfig``
#: (``ctypes.util``), ``uname``. A fast test may set them off; the guard lets them through.
LIBRARY_PROBES = frozenset({"file", "g++", "gcc", "c++", "cc", "ldconfig", "uname"})

_SERVER_MODULES = {MODULES["vllm"]: "vLLM", FP8_SERVER_MODULE: "vLLM", MODULES["sglang"]: "SGLang"}
_TP_FLAGS = {"vLLM": "--tensor-parallel-size", "SGLang": "--tp"}


def engine_start(argv: Argv) -> EngineStart | None:
    """What ``argv`` (a ``subprocess.Popen`` command, any prefix such as ``nice -n 5`` allowed) starts:
    a vLLM or SGLang server (``python -m <server module>``, or through tests/support/fork_start.py),
    ``stitchboard demo``, or None for anything else."""
    args = _words(argv)
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else ""
        if arg == "-m" and following in _SERVER_MODULES:
            kind = _SERVER_MODULES[following]
        elif Path(arg).name == "fork_start.py" and following in MODULES:
            kind = _SERVER_MODULES[MODULES[following]]
        elif Path(arg).name == "stitchboard" and following == "demo":
            return EngineStart("demo")
        else:
            continue
        flag = _TP_FLAGS[kind]
        value = args[args.index(flag, i) + 1] if flag in args[i:-1] else "1"
        return EngineStart(kind, int(value) if value.isdigit() else 1)
    return None


def _words(argv: Argv) -> list[str]:
    """A ``Popen`` command as words (a shell command line split at whitespace: enough to recognise it)."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        return os.fsdecode(argv).split()
    return [os.fsdecode(a) for a in argv]


def fixture_key(func: Callable, name: str, root: Path) -> str:
    """``"<file>::<name>"`` of a fixture function, its file relative to ``root`` (the key of :data:`TIER_FIXTURES`)."""
    try:
        path = Path(inspect.getfile(func)).resolve()
    except TypeError:  # built-in (e.g. the pseudo-fixture of a parametrized argument)
        return name
    return f"{path.relative_to(root).as_posix() if path.is_relative_to(root) else path}::{name}"


class _Guard:
    """The session's state: the test running now, the starts seen, the refusals not yet reported."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.starts: collections.Counter[str] = collections.Counter()
        self.refused: dict[str, list[str]] = collections.defaultdict(list)

    def audit(self, event: str, args: tuple) -> None:
        """The audit hook: checks every ``subprocess.Popen`` (args: executable, argv, cwd, env)."""
        if event != "subprocess.Popen":
            return
        start, item = engine_start(args[1]), self.item
        if start is None:
            words = _words(args[1])
            if item is None or (words and Path(words[0]).name in LIBRARY_PROBES):
                return
            if not any(item.get_closest_marker(m) for m in ("slow", "engine")):
                self._refuse(
                    UnmarkedProcessStart,
                    "a process without the mark slow: mark the test or its module slow, or start it from a fixture "
                    "listed with slow",
                    args[1],
                )
            return
        missing = [m for m in start.needs if item is None or item.get_closest_marker(m) is None]
        if missing:
            self._refuse(
                UnmarkedEngineStart,
                f"{start} without the mark(s) {', '.join(missing)}: mark the test, or start the engine from a fixture "
                "listed",
                args[1],
            )
        self.starts[str(start)] += 1

    def _refuse(self, error: type[RuntimeError], what: str, argv: Argv) -> NoReturn:
        """Record and raise ``error``: the running test started ``what`` (its fix ends the sentence)."""
        where = self.item.nodeid if self.item is not None else "outside any test"
        message = (
            f"{where} started {what} in tests/support/tiers.py TIER_FIXTURES (docs/testing.md); command: "
            f"{shlex.join(_words(argv))[:300]}"
        )
        self.refused[where].append(message)
        raise error(message)


_GUARD = _Guard()
_HOOKED: list[bool] = []  # an audit hook cannot be removed: installed once per process


def pytest_configure(config: pytest.Config) -> None:
    for mark, meaning in TIER_MARKS.items():
        config.addinivalue_line("markers", f"{mark}: {meaning}")
    if not _HOOKED:
        sys.addaudithook(_GUARD.audit)
        _HOOKED.append(True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add each test's tier marks (see the module's docstring)."""
    root = config.rootpath
    for item in items:
        marks: set[str] = set()
        defs = getattr(item, "_fixtureinfo", None)
        for name in getattr(item, "fixturenames", ()):
            chain = defs.name2fixturedefs.get(name) if defs is not None else None
            if chain:  # the last definition is the one this test gets (the closest override)
                marks.update(TIER_FIXTURES.get(fixture_key(chain[-1].func, name, root), ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None and isinstance(callspec.params.get("tp"), int) and callspec.params["tp"] > 1:
            marks.add("heavy")
        for mark in sorted(marks):
            if item.get_closest_marker(mark) is None:
                item.add_marker(mark)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    _GUARD.item = item
    try:
        return (yield)
    finally:
        _GUARD.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Fail a phase that refused an engine start, even where the test caught the error."""
    report = yield
    refused = _GUARD.refused.pop(item.nodeid, None)
    if refused and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(refused)
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    """One line: the engines this session started, by kind and TP."""
    if _GUARD.starts:
        counts = ", ".join(f"{kind} x{n}" for kind, n in sorted(_GUARD.starts.items()))
        terminalreporter.write_line(f"engine starts: {sum(_GUARD.starts.values())} ({counts})")
