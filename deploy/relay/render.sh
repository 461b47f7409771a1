#!/bin/sh
# Render relay.conf.template the way the official nginx image does (envsubst of the set STITCH_RELAY_* variables
# only, so nginx's own $variables stay): render.sh OUT.conf. Needs envsubst (Debian: gettext-base).
set -eu
here=$(dirname "$0")
vars=$(env | sed -n 's/^\(STITCH_RELAY_[A-Z_]*\)=.*/${\1}/p' | tr '\n' ' ')
envsubst "$vars" < "$here/relay.conf.template" > "$1"
