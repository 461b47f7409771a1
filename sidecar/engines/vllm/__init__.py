"""vLLM: the adapter the sidecar drives (:mod:`.adapter`) and the worker extension that runs
inside vLLM's worker processes (:mod:`.worker`, with :mod:`.layout`, :mod:`.weights`,
:mod:`.update`). See :mod:`stitchboard.sidecar.engines` for which process runs each module."""
