# The official vLLM OpenAI-server image plus stitchboard, so that vLLM can load the worker
# extension stitchboard.sidecar.vllm_worker.StitchWorkerExtension (--worker-extension-cls).
#   docker build -f deploy/docker/vllm.Dockerfile -t stitchboard/vllm:0.1.0 .
# Run it with VLLM_SERVER_DEV_MODE=1 (the sidecar drives the engine through the dev routes)
# and --host 127.0.0.1, so those routes are reachable only from the sidecar beside it.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# Build stage: the same image (same Python and C library as the runtime), which ships a C
# compiler for triton; builds the stitchboard wheel (codec kernel included).
FROM ${VLLM_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY bulletin bulletin
COPY trainer_client trainer_client
COPY sidecar sidecar
COPY demo demo
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${VLLM_IMAGE}
# vLLM already ships torch, FastAPI, uvicorn, pydantic; pip adds only what is missing
# (zstandard, xxhash, typer, ...) and keeps vLLM's pinned versions where they satisfy ours.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir "$(echo /wheels/stitchboard-*.whl)[sidecar]" \
    && python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('stitchboard.sidecar.vllm_worker') is None)"
ENV VLLM_SERVER_DEV_MODE=1
