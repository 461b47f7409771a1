"""``stitchboard demo``: a real RL loop syncing a real model into real vLLM engines.

It uses every part of the system, so it lives beside them, not in the trainer SDK:
:mod:`.loop` (the run and its bit-exact oracle) with :mod:`.grpo` and :mod:`.task`, :mod:`.engines`
(vLLM + sidecar pairs and their requests), :mod:`.processes` (child processes and free ports, also
used by the tests), :mod:`.smollm2` (the SmolLM2 test checkpoint, ``stitchboard model``), and
:mod:`.errors`.
"""
