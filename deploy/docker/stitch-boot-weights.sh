#!/bin/sh
# Boot step of a rollout engine (compose service "boot", Kubernetes init container
# "boot-weights"): decides which weights vLLM starts from, before vLLM starts.
#
#   STITCH_BOOT_FROM=run   (default) wait until the run has a version, pull it as a plain
#                          checkpoint + run assets (`stitchboard pull`, verified against its
#                          manifest) into $STITCH_BOOT_DIR/v<N>, point $STITCH_BOOT_DIR/boot at
#                          it (vLLM serves that folder) and write N to $STITCH_BOOT_DIR/boot.version;
#                          stitch-sidecar then starts the sidecar with boot version N.
#                          The version is $STITCH_BOOT_VERSION when set, else the run's latest.
#   STITCH_BOOT_FROM=base  vLLM starts from the base model the run started from (its own model
#                          argument); nothing is pulled and boot.version is removed, so the
#                          sidecar loads the run's nearest anchor into the engine.
#
# The bulletin, run and token are the sidecar's own settings: STITCH_SIDECAR_BULLETIN,
# STITCH_SIDECAR_RUN, STITCH_SIDECAR_TOKEN. STITCH_BOOT_DIR defaults to /models.
set -eu

dir="${STITCH_BOOT_DIR:-/models}"
mode="${STITCH_BOOT_FROM:-run}"
bulletin="${STITCH_SIDECAR_BULLETIN:?STITCH_SIDECAR_BULLETIN is not set}"
run="${STITCH_SIDECAR_RUN:?STITCH_SIDECAR_RUN is not set}"
# `stitchboard versions` and `stitchboard pull` read the token from STITCH_CLIENT_TOKEN (kept out of argv).
if [ -n "${STITCH_SIDECAR_TOKEN:-}" ]; then
    STITCH_CLIENT_TOKEN="$STITCH_SIDECAR_TOKEN"
    export STITCH_CLIENT_TOKEN
fi

case "$mode" in
    base)
        rm -f "$dir/boot.version"
        echo "boot: vLLM starts from its base model; the sidecar will load run $run's nearest anchor"
        exit 0
        ;;
    run) ;;
    *)
        echo "boot: STITCH_BOOT_FROM must be 'run' or 'base', not '$mode'" >&2
        exit 2
        ;;
esac

version="${STITCH_BOOT_VERSION:-}"
if [ -z "$version" ]; then
    # Long-poll until the run has a version (the trainer may not have published yet); a
    # bulletin that is not up yet is retried too.
    while ! out=$(stitchboard versions latest --bulletin "$bulletin" --run "$run" --wait-s 20 --json); do
        echo "boot: waiting for a version of run $run on $bulletin"
        sleep 2
    done
    version=$(printf '%s' "$out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')
fi

target="$dir/v$version"
if [ ! -d "$target" ]; then
    partial="$dir/.v$version.partial"
    rm -rf "$partial"
    stitchboard pull --bulletin "$bulletin" --run "$run" --version "$version" --output "$partial"
    mv "$partial" "$target"
fi
ln -sfn "v$version" "$dir/boot"
printf '%s\n' "$version" > "$dir/.boot.version.tmp"
mv "$dir/.boot.version.tmp" "$dir/boot.version"
# Keep only the folder the engine boots from.
for old in "$dir"/v*; do
    if [ "$old" != "$target" ] && [ -d "$old" ]; then rm -rf "$old"; fi
done
echo "boot: vLLM starts from version $version of run $run ($target)"
