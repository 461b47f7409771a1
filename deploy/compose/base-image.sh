#!/bin/sh
# A local stand-in for the official python:3.11-slim-bookworm image, for machines that reach no image
# registry (the compose check and smoke run here): Debian bookworm's own Python 3.11 (minbase, built by
# mmdebstrap from the Debian mirror), imported into Docker as one layer. The Dockerfiles take it as
# --build-arg BASE_IMAGE=<tag>; users keep the official image (the Dockerfiles' default).
#
#   deploy/compose/base-image.sh TAG     (root; needs mmdebstrap and a running Docker engine)
#
# Differences from the official image that the Dockerfiles rely on being harmless: Python is Debian's
# (python3.11, `python` via python-is-python3), pip installs into /usr/local as in the official image
# (Debian's EXTERNALLY-MANAGED marker removed), and the build tools (gcc, libc6-dev, python3-dev) are
# already in. The host's extra CA certificates are copied in, so pip and apt inside builds reach the
# same mirrors the host does. The mirror is the host's Debian mirror (MIRROR overrides it).
set -eu

tag="${1:?usage: base-image.sh TAG}"
mirror="${MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)}"
mirror="${mirror:-http://deb.debian.org/debian}"
work=$(mktemp -d /tmp/stitch-base.XXXXXX)
trap 'rm -rf "$work"' EXIT

mmdebstrap --quiet --variant=minbase --mode=root \
    --include=python3,python3-pip,python3-venv,python3-dev,python-is-python3,passwd,gcc,libc6-dev,ca-certificates,curl \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    bookworm "$work/rootfs.tar" "$mirror"
docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$work/rootfs.tar" "$tag" >/dev/null
echo "base image $tag: Debian bookworm, $(docker run --rm "$tag" python --version)"
