"""docker-compose.yml, checked by Docker Compose itself (``docker-compose config``, no engine needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_helpers import (
    CHECK_OVERRIDE,
    COMPOSE_FILE,
    ENV_EXAMPLE,
    REPO,
    SECRET_KEYS,
    WORKER_EXTENSION,
    run_compose,
    secret_env_file,
)

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compose(tmp_path_factory) -> dict[str, Any]:
    """The resolved compose model (every profile), with .env.example + generated secrets."""
    secrets = secret_env_file(tmp_path_factory.mktemp("compose"))
    r = run_compose(
        ["--profile", "trainer", "--profile", "relay", "config", "--format", "json"], [ENV_EXAMPLE, secrets]
    )
    assert r.returncode == 0, f"docker-compose config rejected docker-compose.yml:\n{r.stderr}"
    return json.loads(r.stdout)


def env_of(service: dict[str, Any]) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in (service.get("environment") or {}).items()}


def test_compose_config_is_valid(compose):
    assert set(compose["services"]) == {
        "minio",
        "create-bucket",
        "bulletin",
        "trainer",
        "relay",
        "boot",
        "vllm",
        "sidecar",
    }


def test_compose_refuses_to_start_without_secrets():
    """The example file alone leaves every secret empty: compose names each one and stops."""
    r = run_compose(["config", "--quiet"], [ENV_EXAMPLE])
    assert r.returncode != 0
    for key in SECRET_KEYS:
        assert f"required variable {key} is missing a value" in r.stderr, r.stderr


def test_compose_validator_rejects_a_broken_file(tmp_path):
    """Proof that `config` validates: an unknown service key and a bad depends_on condition fail."""
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["bulletin"]["healthcheck"]["intervall"] = "5s"
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(model))
    r = run_compose(["config", "--quiet"], [ENV_EXAMPLE, secret_env_file(tmp_path)], compose_file=bad)
    assert r.returncode != 0 and "intervall" in r.stderr, r.stderr


def test_secrets_come_only_from_env_file():
    """No secret value is written in the compose file or the example env file."""
    text = COMPOSE_FILE.read_text()
    for var in (
        "MINIO_ROOT_USER",
        "MINIO_ROOT_PASSWORD",
        "S3_ACCESS_KEY_ID",
        "S3_SECRET_ACCESS_KEY",
        "STITCH_BULLETIN_S3_ACCESS_KEY_ID",
        "STITCH_BULLETIN_S3_SECRET_ACCESS_KEY",
        "STITCH_SIDECAR_TOKEN",
        "STITCH_CLIENT_TOKEN",
        "HF_TOKEN",
    ):
        for m in re.finditer(rf"^\s*{var}:\s*(.*)$", text, re.MULTILINE):
            assert m.group(1).startswith("${"), f"{var} is hard-coded in docker-compose.yml: {m.group(0).strip()}"
    example = dict(
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#")
    )
    for key in (*SECRET_KEYS, "HF_TOKEN"):
        assert example[key] == "", f".env.example must leave {key} empty"
    assert ".env" in Path(COMPOSE_FILE.parent / ".gitignore").read_text().split(), ".env must be git-ignored"


def test_images_are_pinned(compose):
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: image {image} is not pinned"
    assert compose["services"]["vllm"]["build"]["args"]["VLLM_IMAGE"].startswith("vllm/vllm-openai:v")


def test_start_order_and_health_checks(compose):
    s = compose["services"]
    dep = {name: {k: v["condition"] for k, v in (svc.get("depends_on") or {}).items()} for name, svc in s.items()}
    assert dep["create-bucket"] == {"minio": "service_healthy"}
    assert dep["bulletin"] == {"minio": "service_healthy", "create-bucket": "service_completed_successfully"}
    assert dep["trainer"] == {"bulletin": "service_healthy"}
    assert dep["boot"] == {"bulletin": "service_healthy"}
    assert dep["vllm"] == {"boot": "service_completed_successfully"}
    assert dep["sidecar"] == {"vllm": "service_healthy"}
    for name in ("minio", "bulletin", "vllm", "sidecar"):
        assert s[name]["healthcheck"]["test"], f"{name} has no health check"
    assert "/readyz" in " ".join(s["bulletin"]["healthcheck"]["test"])
    assert "/health" in " ".join(s["sidecar"]["healthcheck"]["test"])
    assert s["trainer"]["profiles"] == ["trainer"]
    assert dep["relay"] == {"bulletin": "service_healthy"} and s["relay"]["profiles"] == ["relay"]
    assert "/relay-health" in " ".join(s["relay"]["healthcheck"]["test"])


def test_the_optional_relay_renders_the_shipped_template_in_front_of_the_bulletin(compose):
    """The relay service (profile ``relay``) mounts deploy/relay's template where the nginx image renders it, sets
    every variable the template names, points it at the bulletin's port, keeps the read-check cache on a tmpfs, and
    the sidecar's STITCH_SIDECAR_RELAYS defaults to none."""
    relay = compose["services"]["relay"]
    template = REPO / "deploy" / "relay" / "relay.conf.template"
    mount = next(v for v in relay["volumes"] if v.get("source") == str(template))
    assert mount["target"] == "/etc/nginx/templates/relay.conf.template" and mount["read_only"]
    env = env_of(relay)
    assert set(re.findall(r"\$\{(STITCH_RELAY_[A-Z_]+)\}", template.read_text())) == set(env)
    bulletin_port = env_of(compose["services"]["bulletin"])["STITCH_BULLETIN_PORT"]
    assert env["STITCH_RELAY_ORIGIN"] == f"bulletin:{bulletin_port}"
    assert env["STITCH_RELAY_AUTH_DIR"] in {t.split(":")[0] for t in relay["tmpfs"]}
    assert [p["target"] for p in relay["ports"]] == [int(env["STITCH_RELAY_LISTEN"])]
    assert env_of(compose["services"]["sidecar"])["STITCH_SIDECAR_RELAYS"] == "[]"


def test_bulletin_runs_on_the_s3_store(compose):
    env = env_of(compose["services"]["bulletin"])
    assert env["STITCH_BULLETIN_STORE"].startswith("s3://")
    assert env["STITCH_BULLETIN_S3_ENDPOINT_URL"] == "http://minio:9000"
    bucket_step = " ".join(compose["services"]["create-bucket"]["command"])
    assert "mc mb --ignore-existing" in bucket_step


def test_vllm_and_sidecar_share_a_namespace_and_a_memory_volume(compose):
    s = compose["services"]
    vllm, sidecar = s["vllm"], s["sidecar"]
    argv = vllm["entrypoint"] + vllm["command"]
    assert argv[:2] == ["vllm", "serve"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1", "vLLM's dev routes must stay inside its namespace"
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert env_of(vllm)["VLLM_SERVER_DEV_MODE"] == "1"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"

    assert sidecar["network_mode"] == "service:vllm"
    sc_env = env_of(sidecar)
    # Only the sidecar's port is published (on vllm, the namespace owner), never vLLM's.
    assert [p["target"] for p in vllm["ports"]] == [int(sc_env["STITCH_SIDECAR_PORT"])]
    assert sc_env["STITCH_SIDECAR_ENGINE_URL"] == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"

    handoff = compose["volumes"]["handoff"]
    assert handoff["driver_opts"]["type"] == "tmpfs"
    mounts = {
        name: {v["target"] for v in s[name]["volumes"] if v["source"] == "handoff"} for name in ("vllm", "sidecar")
    }
    assert mounts["vllm"] == mounts["sidecar"] == {sc_env["STITCH_SIDECAR_HANDOFF_DIR"]}, (
        "the hand-off folder must be the same path in both"
    )


def test_engine_boot_from_the_run(compose):
    s = compose["services"]
    boot_env = env_of(s["boot"])
    assert s["boot"]["entrypoint"] == ["stitch-boot-weights"]
    assert boot_env["STITCH_BOOT_FROM"] == "run"
    boot_dir = boot_env["STITCH_BOOT_DIR"]
    model = s["vllm"]["command"][0]
    assert model == f"{boot_dir}/boot", "vLLM must serve the folder the boot step pulls into"
    for name in ("boot", "vllm", "sidecar"):
        assert any(v["source"] == "models" and v["target"] == boot_dir for v in s[name]["volumes"]), name
    assert env_of(s["sidecar"])["STITCH_BOOT_DIR"] == boot_dir
    for key in ("STITCH_SIDECAR_BULLETIN", "STITCH_SIDECAR_RUN", "STITCH_SIDECAR_TOKEN"):
        assert boot_env[key] == env_of(s["sidecar"])[key], f"boot step and sidecar disagree on {key}"


def test_the_check_override_swaps_only_the_s3_server_and_the_engine(tmp_path):
    """deploy/compose/check.yml (make compose-check): the S3 service becomes radosgw under the same name and port, the
    bucket step uses boto3 from the bulletin image, the engine services leave the default profile, the sidecar gets
    its own network namespace and port; the bulletin and sidecar run exactly the users' settings and images."""
    env_files = [ENV_EXAMPLE, secret_env_file(tmp_path)]
    models = []
    for overrides in ((), (CHECK_OVERRIDE,)):
        r = run_compose(["config", "--format", "json"], env_files, overrides=overrides)
        assert r.returncode == 0, r.stderr
        models.append(json.loads(r.stdout))
    base, s = models[0]["services"], models[1]["services"]
    assert set(s) == set(base) - {"boot", "vllm"}, "the engine services stay out"
    assert s["minio"]["image"].startswith("stitchboard/s3-radosgw:") and "mc" not in str(s["minio"]["healthcheck"])
    assert env_of(s["minio"])["S3_ACCESS_KEY_ID"] == env_of(base["bulletin"])["STITCH_BULLETIN_S3_ACCESS_KEY_ID"]
    assert env_of(s["create-bucket"])["BUCKET"] in env_of(base["bulletin"])["STITCH_BULLETIN_STORE"]
    assert s["create-bucket"]["entrypoint"] == ["python", "/opt/stitch/create-bucket.py"]
    assert (REPO / "deploy" / "compose" / "create-bucket.py").is_file()
    for name in ("bulletin", "sidecar"):
        assert s[name]["image"] == base[name]["image"] and env_of(s[name]) == env_of(base[name]), name
        assert s[name]["healthcheck"]["test"] == base[name]["healthcheck"]["test"], name
    assert "network_mode" not in s["sidecar"] and s["sidecar"]["depends_on"].keys() == {"bulletin"}
    assert [p["target"] for p in s["sidecar"]["ports"]] == [8000]
    assert all(s[name].get("mem_limit") for name in ("minio", "bulletin", "sidecar"))
