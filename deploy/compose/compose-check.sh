#!/bin/sh
# `make compose-check`: the compose stack's S3 server (radosgw), bulletin and sidecar built and started
# on a real Docker engine, without the engine image (CI's light check; the full stack is
# deploy/compose/compose-smoke.sh). Root: starts its own dockerd on a temporary data root when none runs.
#
# Builds the base stand-in (deploy/compose/base-image.sh), the bulletin, sidecar and radosgw images;
# runs docker-compose.yml + deploy/compose/check.yml with a generated env file; walks the faults of
# issue #34 (sidecar before the bulletin, a missing bucket, wrong S3 keys, no engine) and checks that
# each is named in the service's log and health check and that `up -d` heals it; publishes and pulls
# two versions through the bulletin over HTTP; tears everything down (containers, volumes, images,
# the daemon it started, its data root). Prints `ok <check>` lines; the last line is PASS or FAIL,
# and the exit status is 0 iff PASS.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO" || exit 1
. deploy/compose/lib.sh
WORK=$(mktemp -d /tmp/stitch-compose.XXXXXX)
PROJECT="stitch-check-$$"
TAG=0.1.0
BULLETIN_PORT=$(free_port)
ROLLOUT_PORT=$(free_port)
BULLETIN_URL_IN_STACK=http://bulletin:8700
trap 'docker_down' EXIT

host_roundtrip() { # publish two versions from the host, list, pull back bit-exact (deploy/compose/roundtrip.py)
	STITCH_CLIENT_TOKEN=$(env_value TRAINER_TOKEN) "$REPO/.venv/bin/python" deploy/compose/roundtrip.py \
		"http://127.0.0.1:$BULLETIN_PORT" "$(env_value RUN_ID)" "$WORK/roundtrip"
}
trap 'exit 1' INT TERM

compose_with() { # ENV_FILE ARGS...: docker compose on the check override, with that env file
	env_file=$1
	shift
	$COMPOSE_BIN --project-name "$PROJECT" --project-directory "$REPO" --env-file "$env_file" \
		-f docker-compose.yml -f deploy/compose/check.yml "$@"
}
COMPOSE="compose_with $WORK/.env"

start=$(date +%s)
docker_up || fail "no Docker engine"
write_env "$WORK/.env"
build_image stitchboard/base:bookworm-check base || fail "base image"
build_service_images
ok "images built in $(($(date +%s) - start)) s: $(image_sizes)"

# 1. The sidecar first, before the bulletin and with no engine: it waits (never exits), its log names the
#    engine it waits for, its health check fails with /health's state.
$COMPOSE up -d --no-deps sidecar >/dev/null 2>&1 || fail "compose up sidecar"
wait_log sidecar "engine at http://127.0.0.1:8001 does not answer" 60 ||
	fail "the sidecar's log does not name the engine it waits for"
health_says sidecar "health 503" "waiting_for_engine" 60 || fail "the sidecar's health check does not say it waits for the engine"
ok "sidecar first, no engine: it waits; log: $(log_line sidecar 'engine at http' | sed 's/^.*WARNING //'); health check: 503 waiting_for_engine"

# 2. A missing bucket: the bulletin without create-bucket is not ready and its log names the bucket.
$COMPOSE up -d --no-deps minio >/dev/null 2>&1 || fail "compose up minio"
wait_health minio healthy 120 || fail "radosgw never healthy"
ok "S3 server (radosgw) healthy"
$COMPOSE up -d --no-deps bulletin >/dev/null 2>&1 || fail "compose up bulletin"
wait_log bulletin "bucket 'stitchboard' .*does not exist" 60 || fail "the bulletin's log does not name the missing bucket"
health_says bulletin "readyz 503" "not ready" 30 || fail "the bulletin's health check passes without a bucket"
ok "missing bucket: health check fails (readyz 503 not ready); log: $(log_line bulletin 'not ready' | sed 's/^.*WARNING //')"

# 3. Healing: `up -d` creates the bucket and brings the bulletin to health.
$COMPOSE up -d >/dev/null 2>&1 || fail "compose up -d"
wait_health bulletin healthy 120 || fail "the bulletin did not become healthy after up -d"
ok "up -d heals it: bucket created, bulletin healthy"

# 4. Wrong S3 keys: a bulletin recreated with a wrong secret is unhealthy and says why; the right .env heals it.
sed "s/^S3_SECRET_ACCESS_KEY=.*/S3_SECRET_ACCESS_KEY=wrong-secret-key-0000/" "$WORK/.env" >"$WORK/wrong.env"
compose_with "$WORK/wrong.env" up -d --no-deps bulletin >/dev/null 2>&1 || fail "compose up bulletin (wrong keys)"
wait_log bulletin "not ready: .*(SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied|credentials|keys)" 60 ||
	fail "the bulletin's log does not say the S3 keys are wrong"
health_says bulletin "readyz 503" "not ready" 30 || fail "the bulletin's health check passes with wrong S3 keys"
ok "wrong S3 keys: health check fails (readyz 503 not ready); log: $(log_line bulletin 'not ready' | sed 's/^.*WARNING //')"
$COMPOSE up -d >/dev/null 2>&1 || fail "compose up -d"
wait_health bulletin healthy 120 || fail "the bulletin did not become healthy with the right keys"
ok "the right .env and up -d heal it: bulletin healthy"

# 5. The bulletin over HTTP: two versions published from the host, listed, pulled back bit-exact.
host_roundtrip || fail "publish/pull through the bulletin"

# 6. The sidecar still up, still naming the engine (the one service the check leaves unhealthy).
[ "$(health sidecar)" = unhealthy ] || [ "$(health sidecar)" = starting ] || fail "sidecar: $(health sidecar)"
health_says sidecar "health 503" "waiting_for_engine" 10 || fail "the sidecar's health check changed"
ok "sidecar beside no engine after the heals: still up, health check 503 waiting_for_engine"
pass "compose check in $(($(date +%s) - start)) s"
