"""Benchmarks (they print figures; not collected as tests): run each from the repo root as
``python -m tests.benchmarks.bench_NAME``."""
