"""deploy/k8s/*.yaml, validated against the Kubernetes JSON schemas (offline, strict)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from tests.deploy.deploy_helpers import (
    K8S_DIR,
    K8S_MANIFESTS,
    WORKER_EXTENSION,
    k8s_docs,
    k8s_object,
    missing_tool,
    pod_containers,
)

#: 1.29: the first release with native sidecar containers on by default; and the newest schemas.
K8S_VERSIONS = ("1.29.0", "latest")


@pytest.fixture(scope="module")
def kv():
    try:
        import kubernetes_validate
    except ImportError:
        missing_tool("kubernetes-validate")
    return kubernetes_validate


def _version(kv, v: str) -> str:
    return kv.latest_version() if v == "latest" else v


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_kubernetes_schema(kv, path, version):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} holds no object"
    for doc in docs:
        kv.validate(doc, _version(kv, version), strict=True)


def test_validator_rejects_broken_objects(kv):
    """Proof that the schemas bite: a misspelt field, a wrong type, and a native sidecar before 1.28."""
    dep = k8s_object("Deployment", "stitchboard-rollout")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, "1.27.0", strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_example():
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S_MANIFESTS if p.name != "secret.example.yaml")


def test_bulletin_is_two_stateless_replicas_behind_a_service():
    dep = k8s_object("Deployment", "stitchboard-bulletin")
    assert dep["spec"]["replicas"] == 2
    spec = dep["spec"]["template"]["spec"]
    assert not [v for v in spec.get("volumes", []) if "persistentVolumeClaim" in v], (
        "the bulletin keeps no state of its own"
    )
    (c,) = spec["containers"]
    assert c["args"] == ["bulletin", "serve"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    svc = k8s_object("Service", "stitchboard-bulletin")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


def test_rollout_pod_runs_vllm_beside_a_native_sidecar():
    dep = k8s_object("Deployment", "stitchboard-rollout")
    spec = dep["spec"]["template"]["spec"]
    inits = {c["name"]: c for c in spec["initContainers"]}
    assert list(inits) == ["boot-weights", "sidecar"], "the boot step must finish before the sidecar and vLLM start"
    sidecar = inits["sidecar"]
    assert sidecar["restartPolicy"] == "Always"
    assert "restartPolicy" not in inits["boot-weights"]
    assert inits["boot-weights"]["command"] == ["stitch-boot-weights"]
    (vllm,) = spec["containers"]

    # Readiness is the sidecar's /health; the Service targets the sidecar's port only.
    probe = sidecar["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "http"
    sidecar_port = {p["name"]: p["containerPort"] for p in sidecar["ports"]}["http"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert int(env["STITCH_SIDECAR_PORT"]) == sidecar_port and env["STITCH_SIDECAR_HOST"] == "0.0.0.0"
    svc = k8s_object("Service", "stitchboard-rollout")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    # vLLM: dev mode, the worker extension, loopback only, no container port, GPU requested.
    argv = vllm["command"] + vllm["args"]
    assert argv[:2] == ["vllm", "serve"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert {e["name"]: e["value"] for e in vllm["env"]}["VLLM_SERVER_DEV_MODE"] == "1"
    assert "ports" not in vllm, "vLLM's port must not be declared: its dev routes stay inside the pod"
    assert vllm["resources"]["requests"]["nvidia.com/gpu"] == vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe_name in ("startupProbe", "livenessProbe"):
        assert "exec" in vllm[probe_name], "kubelet cannot reach 127.0.0.1: vLLM's probes must be exec probes"
    config = k8s_object("ConfigMap", "stitchboard-rollout")["data"]
    assert config["STITCH_SIDECAR_ENGINE_URL"] == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"

    # Hand-off: one memory-backed emptyDir, mounted at STITCH_SIDECAR_HANDOFF_DIR in both.
    volumes = {v["name"]: v for v in spec["volumes"]}
    handoff_dir = config["STITCH_SIDECAR_HANDOFF_DIR"]
    for c in (sidecar, vllm):
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == handoff_dir]
        assert volumes[m["name"]]["emptyDir"]["medium"] == "Memory", c["name"]
    # Boot weights: vLLM serves the folder the boot step pulls into.
    boot_dir = config["STITCH_BOOT_DIR"]
    assert argv[2] == f"{boot_dir}/boot"
    for c in (inits["boot-weights"], sidecar, vllm):
        assert any(m["mountPath"] == boot_dir and m["name"] == "models" for m in c["volumeMounts"]), c["name"]


def test_references_resolve_and_secrets_are_not_stored():
    """Every ConfigMap/Secret key a pod reads exists in the manifests; the Secret example holds no value."""
    configmaps = {d["metadata"]["name"]: d["data"] for _, d in k8s_docs() if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d["stringData"] for _, d in k8s_docs() if d["kind"] == "Secret"}
    for name, data in secrets.items():
        assert all(v == "" for v in data.values()), f"Secret {name} in secret.example.yaml must not hold values"
    for _, d in k8s_docs():
        if d["kind"] != "Deployment":
            continue
        for c in pod_containers(d):
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in configmaps, c["name"]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{c['name']}: {ref}"
                if "TOKEN" in e["name"] or "SECRET" in e["name"] or "ACCESS_KEY" in e["name"]:
                    assert ref, f"{c['name']}: {e['name']} must come from a Secret"
    for name, data in configmaps.items():
        assert not [k for k in data if "TOKEN" in k or "SECRET" in k or "ACCESS_KEY" in k], (
            f"secret in ConfigMap {name}"
        )


RELAY_DIR = K8S_DIR / "relay"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_optional_relay_matches_kubernetes_schema(kv, version):
    for doc in [d for d in yaml.safe_load_all((RELAY_DIR / "relay.yaml").read_text()) if d]:
        kv.validate(doc, _version(kv, version), strict=True)


def test_the_relay_component_renders_the_shipped_template_in_front_of_the_bulletin():
    """The relay's ConfigMap is deploy/relay/relay.conf.template verbatim, mounted where the nginx image renders it;
    its container sets every variable the template names and points at the bulletin's Service; read checks are
    cached in memory only; the component points the rollout sidecars at the relay's Service."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((RELAY_DIR / "relay.yaml").read_text()) if d}
    template = (K8S_DIR.parent / "relay" / "relay.conf.template").read_text()
    assert docs["ConfigMap"]["data"]["relay.conf.template"] == template
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert set(re.findall(r"\$\{(STITCH_RELAY_[A-Z_]+)\}", template)) == set(env)
    bulletin = k8s_object("Service", "stitchboard-bulletin")["spec"]["ports"][0]["port"]
    assert env["STITCH_RELAY_ORIGIN"] == f"stitchboard-bulletin:{bulletin}"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/etc/nginx/templates"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert volumes[mounts[env["STITCH_RELAY_AUTH_DIR"]]]["emptyDir"]["medium"] == "Memory"
    assert env["STITCH_RELAY_CACHE_DIR"] in mounts
    assert c["readinessProbe"]["httpGet"]["path"] == "/relay-health"
    service = docs["Service"]["spec"]
    assert service["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert c["ports"][0]["containerPort"] == int(env["STITCH_RELAY_LISTEN"])
    kust = yaml.safe_load((RELAY_DIR / "kustomization.yaml").read_text())
    assert kust["kind"] == "Component" and kust["resources"] == ["relay.yaml"]
    (patch,) = kust["patches"]
    assert patch["target"] == {"kind": "ConfigMap", "name": "stitchboard-rollout"}
    (op,) = yaml.safe_load(patch["patch"])
    assert op["path"] == "/data/STITCH_SIDECAR_RELAYS"
    assert json.loads(op["value"]) == [f"http://{docs['Service']['metadata']['name']}:{service['ports'][0]['port']}"]
