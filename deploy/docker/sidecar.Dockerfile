# The sidecar: `stitchboard sidecar run` beside one vLLM (same pod / network namespace).
# Also runs the boot step that pulls a published version for the engine to start from
# (stitch-boot-weights). No torch, no vLLM: the engine side is the worker extension,
# installed into the vLLM image (deploy/docker/vllm.Dockerfile).
#   docker build -f deploy/docker/sidecar.Dockerfile -t stitchboard/sidecar:0.1.0 .
# Settings are STITCH_SIDECAR_* environment variables (stitchboard.sidecar.settings).
# The base image: the official Python image (pinned); where no registry is reachable, a local stand-in
# built by deploy/compose/base-image.sh (--build-arg BASE_IMAGE=<its tag>).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md deploy/docker/constraints.txt ./
COPY proto proto
COPY bulletin bulletin
COPY trainer_client trainer_client
COPY sidecar sidecar
COPY demo demo
RUN PIP_CONSTRAINT=constraints.txt pip wheel --no-cache-dir --wheel-dir /wheels '.[sidecar]'

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STITCH_SIDECAR_HOST=0.0.0.0 \
    STITCH_SIDECAR_PORT=8000
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels 'stitchboard[sidecar]' \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/stitch stitch \
    && mkdir -p /models /handoff \
    && chown 10001:10001 /models /handoff
COPY --chmod=0755 deploy/docker/stitch-boot-weights.sh /usr/local/bin/stitch-boot-weights
COPY --chmod=0755 deploy/docker/stitch-sidecar.sh /usr/local/bin/stitch-sidecar
USER 10001:10001
WORKDIR /home/stitch
EXPOSE 8000
ENTRYPOINT ["stitch-sidecar"]
