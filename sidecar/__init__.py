"""stitchboard.sidecar: beside one rollout engine, keeps it at the run's latest version and gates requests.

The service (follow the bulletin, fetch, commit, the gating proxy) and, under ``engines/``, each engine's
adapter and the code that runs inside the engine's own processes. Every module, with what it holds and
the process it runs in, is listed in DESIGN.md's map ("Packages and modules"), the one list of them. The
wire (headers, stamps, status body) is :mod:`stitchboard.proto.sidecar_wire`.
"""
