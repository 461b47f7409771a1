"""The deploy files cannot drift from the code: every command, flag and STITCH* variable they use
is one the real CLI, settings classes and deploy scripts accept, and every value parses.

Names come from the code itself: the typer/click command tree of ``stitchboard`` (with its
options' ``envvar``), the fields of ``BulletinSettings`` / ``SidecarSettings`` (env prefix +
field name), the variables the deploy scripts read, and the trainer example's argparse parser.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from stitchboard.sidecar.engines.vllm.launch import VLLM_SERVER_MODULE
from tests.deploy.deploy_helpers import (
    CHECK_OVERRIDE,
    COMPOSE_FILE,
    DOCKER_DIR,
    DOCKERFILES,
    ENV_EXAMPLE,
    K8S_DIR,
    REPO,
    SCRIPTS,
    SMOKE_OVERRIDE,
    TRAINER_EXAMPLE,
    WORKER_EXTENSION,
    bulletin_env_names,
    cli_command,
    command_envvars,
    command_options,
    k8s_object,
    run_compose,
    script_exports,
    script_invocations,
    script_reads,
    secret_env_file,
    sidecar_env_names,
    split_command,
)

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

#: Image name -> Dockerfile, as the compose file and the manifests name them.
IMAGES = {
    "stitchboard/bulletin": "bulletin.Dockerfile",
    "stitchboard/sidecar": "sidecar.Dockerfile",
    "stitchboard/vllm": "vllm.Dockerfile",
    "stitchboard/vllm-cpu": "vllm-cpu.Dockerfile",
    "stitchboard/trainer-example": "trainer.Dockerfile",
}


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> dict[str, Any]:
    r = run_compose(
        ["--profile", "trainer", "--profile", "relay", "config", "--format", "json"],
        [ENV_EXAMPLE, secret_env_file(tmp_path_factory.mktemp("drift"))],
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# -- Dockerfiles --------------------------------------------------------------------------------


def dockerfile_final_stage(path: Path) -> str:
    text = re.sub(r"\\\n", " ", path.read_text())
    return re.split(r"^FROM .*$", text, flags=re.MULTILINE)[-1]


def dockerfile_exec(path: Path, instr: str) -> list[str] | None:
    m = re.findall(rf"^{instr}\s+(\[.*\])\s*$", dockerfile_final_stage(path), re.MULTILINE)
    return json.loads(m[-1]) if m else None


def dockerfile_env(path: Path) -> set[str]:
    names = set()
    for line in re.findall(r"^ENV\s+(.*)$", dockerfile_final_stage(path), re.MULTILINE):
        names.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", line))
    return names


def image_dockerfile(image: str) -> Path:
    return DOCKER_DIR / IMAGES[image.rsplit(":", 1)[0]]


def program_argv(image: str, command: list[str] | None, args: list[str] | None) -> list[str]:
    """What a container runs: its command (or the image's ENTRYPOINT) + its args (or the image's CMD)."""
    df = image_dockerfile(image)
    entry = command if command is not None else dockerfile_exec(df, "ENTRYPOINT") or []
    rest = args if args is not None else (dockerfile_exec(df, "CMD") or [] if command is None else [])
    return [*entry, *rest]


# -- the checks -------------------------------------------------------------------------------


def check_invocation(argv: list[str], where: str) -> None:
    """``argv`` must be a program the deploy files know, called with options it accepts."""
    prog = argv[0]
    if prog == "stitchboard":
        path, flags = split_command(argv[1:])
    elif prog == "stitch-sidecar":  # deploy/docker/stitch-sidecar.sh: `stitchboard sidecar run "$@"`
        path, flags = ["sidecar", "run"], split_command(argv[1:])[1]
    elif prog == "stitch-boot-weights":
        assert argv == [prog], f"{where}: stitch-boot-weights takes no arguments (settings are env vars)"
        return
    elif prog == "vllm":
        assert argv[1] == "serve", where
        assert WORKER_EXTENSION in argv, f"{where}: vLLM without the stitchboard worker extension"
        return
    elif prog == "python" and argv[1:3] == ["-m", VLLM_SERVER_MODULE]:  # the CPU engine image's entry point
        # the image alone (no arguments) is the bare server; a service that runs it must load the extension
        assert len(argv) == 3 or WORKER_EXTENSION in argv, f"{where}: vLLM without the stitchboard worker extension"
        return
    elif prog == "python" and argv[1].endswith("trainer_example.py"):
        opts = {o for a in trainer_parser()._actions for o in a.option_strings}
        unknown = {a for a in argv[2:] if a.startswith("-")} - opts
        assert not unknown, f"{where}: the trainer example has no option {sorted(unknown)}"
        return
    else:
        raise AssertionError(f"{where}: unexpected program {argv}")
    cmd = cli_command(path)
    unknown = set(flags) - command_options(cmd)
    assert not unknown, (
        f"{where}: `stitchboard {' '.join(path)}` has no option {sorted(unknown)} (has {sorted(command_options(cmd))})"
    )


def trainer_parser():
    spec = importlib.util.spec_from_file_location("trainer_example", TRAINER_EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports no torch at module level
    return mod.build_parser()


def accepted_env(role: str) -> set[str]:
    """STITCH* variables a process of ``role`` reads."""
    if role == "bulletin":
        return bulletin_env_names()
    if role == "sidecar":
        return sidecar_env_names() | script_reads("stitch-sidecar")
    if role == "boot":
        return script_reads("stitch-boot-weights")
    if role == "trainer":  # the client variables the example reads, and the demo's model cache
        names = command_envvars(cli_command(["publish"])) | {"STITCH_DEMO_CACHE"}
        source = TRAINER_EXAMPLE.read_text()
        return {n for n in names if n in source or n == "STITCH_DEMO_CACHE"}
    if role == "vllm":  # stitchboard's vLLM plugin, in every vLLM process
        from stitchboard.sidecar.engines.vllm.queue_nap import NAP_ENV

        return {NAP_ENV}
    raise AssertionError(role)


def check_env(names: set[str], role: str, where: str) -> None:
    unknown = {n for n in names if n.startswith("STITCH")} - accepted_env(role)
    assert not unknown, (
        f"{where}: {sorted(unknown)} are read by nothing in the {role} (accepted: {sorted(accepted_env(role))})"
    )


def role_of(argv: list[str]) -> str:
    if argv[1:3] == ["-m", VLLM_SERVER_MODULE]:
        return "vllm"
    if argv[0] == "stitchboard":
        return {"bulletin": "bulletin"}.get(argv[1], argv[1])
    return {"stitch-sidecar": "sidecar", "stitch-boot-weights": "boot", "vllm": "vllm", "python": "trainer"}[argv[0]]


# -- tests ------------------------------------------------------------------------------------


def test_scripts_call_real_commands_with_real_options():
    for name, path in SCRIPTS.items():
        calls = script_invocations(path.read_text())
        assert calls, f"{name} calls no stitchboard command"
        for cmd_path, flags in calls:
            cmd = cli_command(cmd_path)
            unknown = set(flags) - command_options(cmd)
            assert not unknown, f"{name}: `stitchboard {' '.join(cmd_path)}` has no option {sorted(unknown)}"


def test_scripts_read_and_pass_only_real_variables():
    boot_reads = script_reads("stitch-boot-weights")
    # The boot step reads the sidecar's own settings, plus its STITCH_BOOT_* options.
    assert {n for n in boot_reads if n.startswith("STITCH_SIDECAR_")} <= sidecar_env_names()
    assert {n for n in boot_reads if n.startswith("STITCH_")} - sidecar_env_names() == {
        n for n in boot_reads if n.startswith("STITCH_BOOT_")
    }
    # It hands the token to `stitchboard versions latest` / `pull` through their envvar.
    for path in (["versions", "latest"], ["pull"]):
        assert script_exports("stitch-boot-weights") <= command_envvars(cli_command(path)), path
    assert script_exports("stitch-sidecar") <= sidecar_env_names()
    assert {n for n in script_reads("stitch-sidecar") if n.startswith("STITCH_SIDECAR_")} <= sidecar_env_names()


def test_dockerfiles_set_only_real_variables_and_run_real_commands():
    roles = {
        "bulletin.Dockerfile": "bulletin",
        "sidecar.Dockerfile": "sidecar",
        "vllm.Dockerfile": "vllm",
        "vllm-cpu.Dockerfile": "vllm",
        "trainer.Dockerfile": "trainer",
    }
    assert sorted(p.name for p in DOCKERFILES) == sorted(roles)
    for df in DOCKERFILES:
        check_env(dockerfile_env(df), roles[df.name], df.name)
        entry = dockerfile_exec(df, "ENTRYPOINT")
        if entry:
            check_invocation([*entry, *(dockerfile_exec(df, "CMD") or [])], df.name)
        for src in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s", df.read_text(), re.MULTILINE):
            assert (REPO / src).exists(), f"{df.name}: COPY {src}: no such file"
    assert "VLLM_SERVER_DEV_MODE=1" in (DOCKER_DIR / "vllm.Dockerfile").read_text()


def test_compose_services_use_real_commands_variables_and_values(compose, monkeypatch):
    for name, svc in compose["services"].items():
        if not svc["image"].startswith("stitchboard/"):
            continue
        argv = program_argv(svc["image"], svc.get("entrypoint"), svc.get("command"))
        check_invocation(argv, f"compose service {name}")
        env = {k: "" if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}
        check_env(set(env), role_of(argv), f"compose service {name}")

    from stitchboard.bulletin.settings import BulletinSettings
    from stitchboard.sidecar.settings import SidecarSettings

    b = settings_from_env(monkeypatch, BulletinSettings, compose["services"]["bulletin"]["environment"])
    assert b.store.startswith("s3://") and len(b.tokens) == 2
    assert {tuple(g.scopes) for g in b.tokens.values()} == {("publish",), ("replica",)}
    s = settings_from_env(monkeypatch, SidecarSettings, compose["services"]["sidecar"]["environment"])
    assert s.token in b.tokens and b.tokens[s.token].scopes == ["replica"]  # reads and reports, never publishes
    assert s.bulletin == "http://bulletin:8700" and s.port == 8000


def test_k8s_containers_use_real_commands_variables_and_values(monkeypatch):
    configmaps = {n: k8s_object("ConfigMap", n)["data"] for n in ("stitchboard-bulletin", "stitchboard-rollout")}
    readers: dict[str, set[str]] = {n: set() for n in configmaps}
    envs = {}
    for dep in ("stitchboard-bulletin", "stitchboard-rollout"):
        spec = k8s_object("Deployment", dep)["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"{dep}/{c['name']}"
            argv = program_argv(c["image"], c.get("command"), c.get("args"))
            check_invocation(argv, where)
            role = role_of(argv)
            check_env({e["name"] for e in c.get("env", [])}, role, where)
            env = {}
            for src in c.get("envFrom", []):
                cm = src["configMapRef"]["name"]
                readers[cm] |= accepted_env(role)
                env.update(configmaps[cm])
            env.update({e["name"]: e.get("value", "secret-" + e["name"].lower()) for e in c.get("env", [])})
            envs[where] = env
    for cm, keys in configmaps.items():
        unread = {k for k in keys if k.startswith("STITCH")} - readers[cm]
        assert not unread, f"ConfigMap {cm}: {sorted(unread)} are read by no container that loads it"

    from stitchboard.bulletin.settings import BulletinSettings
    from stitchboard.sidecar.settings import SidecarSettings

    assert (
        '"<rollout token>": {"scopes": ["replica"]}' in (K8S_DIR / "secret.example.yaml").read_text()
    )  # sidecars report, never publish
    tokens = json.dumps(
        {"trainer-token": {"scopes": ["publish"]}, "secret-stitch_sidecar_token": {"scopes": ["replica"]}}
    )
    b = settings_from_env(
        monkeypatch, BulletinSettings, {**envs["stitchboard-bulletin/bulletin"], "STITCH_BULLETIN_TOKENS": tokens}
    )
    assert b.store.startswith("s3://") and b.host == "0.0.0.0"
    s = settings_from_env(monkeypatch, SidecarSettings, envs["stitchboard-rollout/sidecar"])
    assert s.bulletin.rstrip("/") == "http://stitchboard-bulletin:{}".format(
        k8s_object("Service", "stitchboard-bulletin")["spec"]["ports"][0]["port"]
    )
    assert s.handoff_dir == "/handoff"


def test_deploy_files_use_no_legacy_names():
    """Legacy variable names are read for now (with a warning); the deploy files use only the new ones."""
    from stitchboard.proto.env import RENAMED_ENV

    files = [
        COMPOSE_FILE,
        ENV_EXAMPLE,
        TRAINER_EXAMPLE,
        REPO / "deploy" / "README.md",
        *DOCKERFILES,
        *SCRIPTS.values(),
        *K8S_DIR.glob("*.yaml"),
    ]
    for path in files:
        text = path.read_text()
        for new, legacy in RENAMED_ENV.items():
            assert not re.search(rf"(?<![A-Z0-9_]){legacy}(?![A-Z0-9_])", text), (
                f"{path.relative_to(REPO)} uses the legacy {legacy}: use {new}"
            )


def _module_file(module: str) -> Path:
    """The source file of ``stitchboard.<part>.<...>`` in this repo (parts are top-level folders)."""
    return REPO.joinpath(*module.split(".")[1:]).with_suffix(".py")


def test_worker_extension_class_exists():
    """The class the deploy files name exists: defined in that module, or re-exported there from
    the module that defines it (a moved public path keeps an alias)."""
    module, cls = WORKER_EXTENSION.rsplit(".", 1)
    path = _module_file(module)
    assert module.startswith("stitchboard.sidecar.") and path.is_file(), (
        f"{module} is not a module of the sidecar package"
    )
    tree = ast.parse(path.read_text())
    if cls not in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}:
        (source,) = [
            n.module for n in tree.body if isinstance(n, ast.ImportFrom) and cls in {a.name for a in n.names}
        ] or [None]
        assert source is not None, f"{path} neither defines nor re-exports a class {cls}"
        path = _module_file(source)
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
        assert cls in defined, f"{path} (re-exported by {module}) defines no class {cls}"


def settings_from_env(monkeypatch, cls, env: dict[str, Any]):
    """Build ``cls()`` from exactly ``env`` (other STITCH* variables of this process removed)."""
    for k in list(os.environ):
        if k.startswith("STITCH"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        if v not in (None, ""):
            monkeypatch.setenv(k, str(v))
    return cls()


def _k8s_container(deployment: str, name: str) -> dict[str, Any]:
    spec = k8s_object("Deployment", deployment)["spec"]["template"]["spec"]
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def _k8s_env(container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(k8s_object("ConfigMap", src["configMapRef"]["name"])["data"])
    env.update({e["name"]: e.get("value", "<secret>") for e in container.get("env", [])})
    return env


def _options(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, [*argv[1:], ""], strict=True) if a.startswith("--")}


#: Settings that differ between the compose smoke and the manifests by design: where the other services are (compose
#: service names vs Kubernetes Services), the S3 endpoint (radosgw in compose, the cloud's S3 in a cluster) and
#: secrets. Every other STITCH* setting either side sets, the other sets to the same value, or leaves at its default
#: (listed per service in SMOKE_ONLY / K8S_ONLY).
SITE = {"STITCH_SIDECAR_BULLETIN", "STITCH_SIDECAR_TOKEN", "STITCH_BULLETIN_TOKENS", "STITCH_BULLETIN_S3_ACCESS_KEY_ID",
        "STITCH_BULLETIN_S3_SECRET_ACCESS_KEY", "STITCH_BULLETIN_STORE"}  # fmt: skip
SMOKE_ONLY = {
    "bulletin": {
        "STITCH_BULLETIN_S3_ENDPOINT_URL",
        "STITCH_BULLETIN_S3_ADDRESSING_STYLE",
        "STITCH_BULLETIN_LOG_FORMAT",
    },
    "sidecar": {"STITCH_SIDECAR_RELAYS", "STITCH_SIDECAR_LOG_FORMAT"},
    "boot": {"STITCH_BOOT_VERSION"},
}
K8S_ONLY = {
    "bulletin": {"STITCH_BULLETIN_KEEP_SNAPSHOTS", "STITCH_BULLETIN_LOG_LEVEL", "STITCH_BULLETIN_UPLOAD_TMP_DIR"},
    "sidecar": {"STITCH_BOOT_FROM"},
    "boot": {"STITCH_SIDECAR_ENGINE", "STITCH_SIDECAR_ENGINE_URL", "STITCH_SIDECAR_HANDOFF_DIR"},
}


def test_k8s_runs_the_images_commands_and_settings_of_the_compose_smoke(tmp_path):
    """Issue #34 item 4: the manifests run what `make compose-smoke` runs (docker-compose.yml + deploy/compose/check.yml
    + smoke.yml): the same bulletin and sidecar images and programs (the boot step, the sidecar, the bulletin), the
    same vLLM server options where both set one (the cluster runs the GPU image, the smoke the CPU one), and the same
    values of every STITCH* setting both set; the settings only one side sets are the listed, deliberate ones."""
    r = run_compose(
        ["--profile", "trainer", "config", "--format", "json"],
        [ENV_EXAMPLE, secret_env_file(tmp_path)],
        overrides=(CHECK_OVERRIDE, SMOKE_OVERRIDE),
    )
    assert r.returncode == 0, r.stderr
    smoke = json.loads(r.stdout)["services"]
    pairs = {
        "bulletin": ("stitchboard-bulletin", "bulletin"),
        "boot": ("stitchboard-rollout", "boot-weights"),
        "sidecar": ("stitchboard-rollout", "sidecar"),
        "vllm": ("stitchboard-rollout", "vllm"),
    }
    for service, (deployment, name) in pairs.items():
        c, s = _k8s_container(deployment, name), smoke[service]
        k8s_argv = program_argv(c["image"], c.get("command"), c.get("args"))
        smoke_argv = program_argv(s["image"], s.get("entrypoint"), s.get("command"))
        if service == "vllm":
            k, m = _options(k8s_argv), _options(smoke_argv)
            assert {"--host", "--port", "--worker-extension-cls"} <= k.keys() & m.keys()
            assert {o: k[o] for o in k.keys() & m.keys()} == {o: m[o] for o in k.keys() & m.keys()}, service
            continue
        assert c["image"] == s["image"], f"{service}: {c['image']} in the manifests, {s['image']} in the smoke"
        assert k8s_argv == smoke_argv, service
        k8s_env = {k: v for k, v in _k8s_env(c).items() if k.startswith("STITCH")}
        smoke_env = {k: str(v) for k, v in (s.get("environment") or {}).items() if k.startswith("STITCH")}
        both = (k8s_env.keys() & smoke_env.keys()) - SITE
        assert {k: k8s_env[k] for k in both} == {k: smoke_env[k] for k in both}, service
        assert smoke_env.keys() - k8s_env.keys() - SITE == SMOKE_ONLY[service], service
        assert k8s_env.keys() - smoke_env.keys() - SITE == K8S_ONLY[service], service
