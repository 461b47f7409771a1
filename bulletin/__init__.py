"""stitchboard.bulletin: where trainers publish versions and rollout engines find them.

A stateless FastAPI service over an object store, its HTTP client and CLIs. Every module, with what it
holds and the process it runs in, is listed in DESIGN.md's map ("Packages and modules"), the one list
of them. Wire bodies live in :mod:`stitchboard.proto` (schema, answers).
"""
