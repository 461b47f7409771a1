"""The SGLang command line: CPU-engine settings on a host without CUDA only."""

from __future__ import annotations

from stitchboard.sidecar.engines.sglang.launch import sglang_command, sglang_env

CPU_ONLY = ("--device", "--disable-overlap-schedule", "--max-total-tokens", "--sleep-on-idle")


def test_cpu_host_gets_the_cpu_engine_settings():
    argv = sglang_command("/m", 30000, tp=2, python="py", cpu=True)
    assert all(flag in argv for flag in CPU_ONLY)
    assert argv[argv.index("--device") + 1] == "cpu"
    env = sglang_env(tp=2, cpu=True)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1


def test_cuda_host_leaves_device_and_cache_to_sglang():
    argv = sglang_command("/m", 30000, tp=2, python="py", cpu=False)
    assert not any(flag in argv for flag in CPU_ONLY)
    assert argv[argv.index("--tp") + 1] == "2" and "--custom-weight-loader" in argv
    assert sglang_env(tp=2, cpu=False) == {}
