"""``stitchboard demo``: a real RL loop syncing a real model into real vLLM engines.

It uses every part of the system, so it lives beside them, not in the trainer SDK. Its modules, with
what each holds, are listed in DESIGN.md's map ("Packages and modules").
"""
