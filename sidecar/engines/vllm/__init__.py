"""vLLM: the adapter the sidecar drives and the worker extension that runs inside vLLM's worker
processes (their modules and processes: DESIGN.md's map)."""
