"""The test suite as one package: helpers import as ``tests.support.app_server``, ``tests.sidecar.fake_engine``, ...

pytest puts the repo root on its import path (``pythonpath`` in pyproject.toml); so does running a
benchmark from the repo root as ``python -m tests.benchmarks.bench_codec``.
"""
