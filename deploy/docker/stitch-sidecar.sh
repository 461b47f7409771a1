#!/bin/sh
# Entry point of the sidecar image: `stitchboard sidecar run` with the given options and the
# STITCH_SIDECAR_* settings. When the boot step pulled a version for the engine
# ($STITCH_BOOT_DIR/boot.version, see stitch-boot-weights) and STITCH_SIDECAR_BOOT_VERSION is
# not set, that version is the engine's boot version.
set -eu

file="${STITCH_BOOT_DIR:-/models}/boot.version"
if [ -z "${STITCH_SIDECAR_BOOT_VERSION:-}" ] && [ -s "$file" ]; then
    STITCH_SIDECAR_BOOT_VERSION=$(cat "$file")
    export STITCH_SIDECAR_BOOT_VERSION
fi
exec stitchboard sidecar run "$@"
