"""stitchboard.sidecar: beside one rollout engine, keeps it at the run's latest version and gates requests.

::

    sidecar/
    ├── cli.py, app.py     ``stitchboard sidecar run``; the FastAPI app           sidecar process
    ├── settings.py        ``STITCH_SIDECAR_*``                                   sidecar process
    ├── gate.py, proxy.py  admission by weight version; the stamping proxy        sidecar process
    ├── claim.py           boot, and the watch that keeps the claim true          sidecar process
    ├── reconciler.py      follow the bulletin, fetch, commit                     sidecar process
    ├── fetch.py           download and verify a plan into the hand-off folder    sidecar process
    ├── metrics.py, errors.py                                                     sidecar process
    ├── client.py          a typed client of a sidecar                            its callers
    └── engines/           adapters (sidecar process) and in-engine code (engine processes)

The wire (headers, stamps, status body) is :mod:`stitchboard.proto.sidecar_wire`.
"""
