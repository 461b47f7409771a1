"""JSON log lines (proto/logs.py): a real bulletin (two worker processes) and a real sidecar process with the
setting on, every line of their output parsed as JSON, the fields of a request that has a run, version, replica
and request id; text stays the default; the fields' sources in one process."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.demo.processes import ProcessGroup, free_port
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.logs import ContextFilter, JsonLines, LogFormat, bind, logging_config
from stitchboard.sidecar.settings import SidecarSettings
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.sidecar.sidecar_helpers import Publisher, make_view, mutate, wait_for

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

RUN, REPLICA = "run-logs", "replica-logs"
CLI = [sys.executable, "-c", "from stitchboard.proto.cli import main; main()"]
# The sidecar's process: the tests' third engine kind (registered at the registry seam, served in a thread),
# then the unchanged `stitchboard sidecar run` in front of it.
SIDECAR = """
import sys
from stitchboard.proto.cli import main
from tests.sidecar.third_engine.engine import SERVING, ThirdEngine
from tests.support.app_server import AppServer
engine = ThirdEngine(token_delay_s=0.001)
server = AppServer(engine.app())
SERVING[server.url] = engine
sys.argv = ["stitchboard", "sidecar", "run", "--engine", "third", "--engine-url", server.url, *sys.argv[1:]]
main()
"""


def _lines(path: Path) -> list[dict]:
    """Every line of a process's output, each parsed as one JSON object (fails on any other line)."""
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{path.name}: not a JSON line: {line!r}")
        assert isinstance(parsed[-1], dict), line
        assert {"time", "level", "logger", "message"} <= parsed[-1].keys(), line
        datetime.fromisoformat(parsed[-1]["time"])
    return parsed


def _one(lines: list[dict], **fields: object) -> dict:
    found = [line for line in lines if all(line.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, found, lines[-20:])
    return found[0]


def test_bulletin_and_sidecar_processes_write_json_lines_with_run_version_replica_and_request_id(tmp_path):
    bulletin_port, sidecar_port = free_port(), free_port()
    bulletin_url, sidecar_url = f"http://127.0.0.1:{bulletin_port}", f"http://127.0.0.1:{sidecar_port}"
    with ProcessGroup(tmp_path / "logs") as group:
        bulletin = group.start(
            "bulletin",
            [*CLI, "bulletin", "serve", "--store", f"file://{tmp_path / 'store'}", "--port", str(bulletin_port)],
            f"{bulletin_url}/healthz",
            env={"STITCH_BULLETIN_LOG_FORMAT": "json", "STITCH_BULLETIN_WORKERS": "2"},
        )
        bulletin.wait_healthy(120)
        with BulletinClient(bulletin_url, retries=1) as client:
            publisher = Publisher(client, RUN, tmp_path)
            publisher.publish(make_view(0))
            sidecar_args = ["--bulletin", bulletin_url, "--run", RUN, "--replica-id", REPLICA]
            sidecar_args += ["--port", str(sidecar_port), "--handoff-dir", str(tmp_path / "handoff")]
            sidecar = group.start(
                "sidecar",
                [sys.executable, "-c", SIDECAR, *sidecar_args, "--poll-wait-s", "2", "--request-wait-s", "30"],
                f"{sidecar_url}/health",
                env={"STITCH_SIDECAR_LOG_FORMAT": "json"},
            )
            sidecar.wait_healthy(120)
            publisher.publish(mutate(publisher.views[-1], 1))  # version 1
            answer = httpx.post(
                f"{sidecar_url}/infer",
                json={"input": "x", "steps": 2},
                headers={"X-Request-Id": "req-sidecar-1", "X-Stitch-Min-Version": "1"},
                timeout=60,
            )
            assert answer.status_code == 200 and answer.headers["x-stitch-version-start"] == "1", answer.text
            read = httpx.get(
                f"{bulletin_url}/v1/runs/{RUN}/versions/1", headers={"X-Request-Id": "req-bulletin-1"}, timeout=30
            )
            assert read.status_code == 200
            missing = httpx.get(f"{bulletin_url}/v1/runs/{RUN}/versions/9", timeout=30)
            assert missing.status_code == 404
            wait_for(lambda: "req-bulletin-1" in bulletin.log_tail(100_000), what="the bulletin's access line")
            wait_for(lambda: "req-sidecar-1" in sidecar.log_tail(100_000), what="the sidecar's access line")
    bulletin_lines, sidecar_lines = _lines(bulletin.log_path), _lines(sidecar.log_path)

    line = _one(sidecar_lines, logger="uvicorn.access", request_id="req-sidecar-1")
    assert (line["run"], line["replica"], line["version"], line["level"]) == (RUN, REPLICA, 1, "INFO")
    assert "POST /infer" in line["message"] and "200" in line["message"]
    assert "color_message" not in line
    startup = next(line for line in sidecar_lines if line["message"].startswith("sidecar following run"))
    assert (startup["logger"], startup["run"], startup["replica"]) == ("stitchboard.sidecar", RUN, REPLICA)
    assert "request_id" not in startup  # a line outside any request

    line = _one(bulletin_lines, logger="uvicorn.access", request_id="req-bulletin-1")
    assert (line["run"], line["version"], line["level"]) == (RUN, 1, "INFO") and "replica" not in line
    assert f"GET /v1/runs/{RUN}/versions/1" in line["message"]
    report = next(line for line in bulletin_lines if f"PUT /v1/runs/{RUN}/replicas/{REPLICA}" in line["message"])
    assert (report["run"], report["replica"]) == (RUN, REPLICA)  # the sidecar's fleet report
    line = _one(bulletin_lines, logger="uvicorn.access", version=9)  # no X-Request-Id: one of its own
    assert len(line["request_id"]) == 32 and "404" in line["message"]
    assert len({line["request_id"] for line in bulletin_lines if "request_id" in line}) >= 4  # one id per request
    started = [line for line in bulletin_lines if line["message"].startswith("Started server process")]
    assert len(started) == 2  # each worker process writes JSON lines too


def test_a_cli_process_in_json_logs_its_warnings_and_tracebacks_as_json_lines():
    script = (
        "import logging, warnings\n"
        "from stitchboard.proto.logs import bind, configure_logging\n"
        "configure_logging('json', logging.INFO, {'run': 'r'}, text_format='%(message)s')\n"
        "warnings.warn('a warning')\n"
        "with bind(version=2):\n"
        "    try:\n"
        "        1 / 0\n"
        "    except ZeroDivisionError:\n"
        "        logging.getLogger('stitchboard.trainer_client').exception('failed')\n"
    )
    argv = [sys.executable, "-W", "default", "-c", script]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    warned, failed = (json.loads(line) for line in done.stderr.splitlines())
    assert (warned["logger"], warned["level"], warned["run"]) == ("py.warnings", "WARNING", "r")
    assert "UserWarning: a warning" in warned["message"]
    assert (failed["message"], failed["version"], failed["run"]) == ("failed", 2, "r")
    assert "ZeroDivisionError" in failed["exc_info"]


def test_the_publish_cli_writes_json_lines_with_its_run(tmp_path):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}"))
    view = make_view(0)
    try:
        for step, (checkpoint, choice) in enumerate(
            [(tmp_path / "c0", {"STITCH_CLIENT_LOG_FORMAT": "json"}), (tmp_path / "c1", {})]
        ):
            save_checkpoint(checkpoint, view if step == 0 else mutate(view, 1))
            argv = [*CLI, "publish", str(checkpoint), "--bulletin", server.url, "--run", RUN, "--skip-rebuild"]
            argv += [] if choice else ["--log-format", "json"]  # the variable, then the option
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=120, env={**os.environ, **choice}
            )
            assert done.returncode == 0 and done.stdout.strip() == str(step), done.stderr
    finally:
        server.stop()
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # the second publish: every line JSON
    assert {(line["logger"], line["run"]) for line in lines} == {("stitchboard.trainer_client", RUN)}
    assert f"run {RUN}: resuming after version 0 (next version is an anchor)" in [line["message"] for line in lines]


def test_text_stays_the_default_of_both_servers():
    assert BulletinSettings(store="file:///tmp/unused").log_format is LogFormat.text
    assert SidecarSettings(bulletin="http://b", run="r", engine_url="http://e").log_format is LogFormat.text
    with pytest.raises(ValueError):
        logging_config("yaml")


def _record(logger: logging.Logger, handler: logging.Handler, message: str, **extra: object) -> None:
    logger.addHandler(handler)
    try:
        logger.warning(message, extra=extra or None)
    finally:
        logger.removeHandler(handler)


def test_fields_come_from_the_process_and_the_bound_context_and_text_lines_carry_none():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonLines())
    handler.addFilter(ContextFilter({"run": "r", "replica": "a", "version": None}))
    logger = logging.getLogger("stitchboard.test_logs")
    logger.propagate = False
    try:
        _record(logger, handler, "outside")
        with bind(request_id="id-1", version=3):
            with bind(version=4):
                _record(logger, handler, "inner %s", step=7)
            _record(logger, handler, "outer")
        text = io.StringIO()
        plain = logging.StreamHandler(text)
        plain.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        plain.addFilter(ContextFilter({"run": "r"}))
        with bind(request_id="id-2"):
            _record(logger, plain, "as text")
    finally:
        logger.propagate = True
    outside, inner, outer = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: outside.get(k) for k in ("run", "replica", "version", "request_id")} == {
        "run": "r",
        "replica": "a",
        "version": None,
        "request_id": None,
    }
    assert (inner["version"], inner["request_id"], inner["step"], inner["message"]) == (4, "id-1", 7, "inner %s")
    assert (outer["version"], outer["request_id"], outer["logger"]) == (3, "id-1", "stitchboard.test_logs")
    assert text.getvalue() == "WARNING stitchboard.test_logs: as text\n"
