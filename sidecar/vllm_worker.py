"""Moved to :mod:`stitchboard.sidecar.engines.vllm.worker`; this path stays for
``--worker-extension-cls stitchboard.sidecar.vllm_worker.StitchWorkerExtension`` command lines."""

from stitchboard.sidecar.engines.vllm.worker import StitchWorkerExtension

__all__ = ["StitchWorkerExtension"]
