"""``stitchboard demo``: a real RL loop syncing a real model into real vLLM engines."""
