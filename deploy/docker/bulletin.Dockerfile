# The bulletin: `stitchboard bulletin serve` over a file:// or s3:// store. No torch, no vLLM.
#   docker build -f deploy/docker/bulletin.Dockerfile -t stitchboard/bulletin:0.1.0 .
# Settings are STITCH_BULLETIN_* environment variables (stitchboard.bulletin.settings).
# The base image: the official Python image (pinned); where no registry is reachable, a local stand-in
# built by deploy/compose/base-image.sh (--build-arg BASE_IMAGE=<its tag>).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

# Build stage: compiles the codec's C kernel (proto/_bitdiff.c) into a wheel, and collects the
# wheels of every dependency of the `bulletin` extra.
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
RUN PIP_CONSTRAINT=constraints.txt pip wheel --no-cache-dir --wheel-dir /wheels '.[bulletin]'

# Runtime stage: no compiler, no sources; only the wheels installed from the build stage.
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STITCH_BULLETIN_HOST=0.0.0.0 \
    STITCH_BULLETIN_PORT=8700
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels 'stitchboard[bulletin]' \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/stitch stitch
USER 10001:10001
WORKDIR /home/stitch
EXPOSE 8700
ENTRYPOINT ["stitchboard"]
CMD ["bulletin", "serve"]
