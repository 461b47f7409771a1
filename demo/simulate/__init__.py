"""``stitchboard simulate``: a discrete-event model (simpy) of one RL step's fan-out to a fleet, and its check
against a real run at small scale. Runs in the operator's process (offline: nothing of a live system is touched).

It lives in ``demo`` because the demo is the part that drives every other part from one operator host (the
bulletin, sidecar fetchers, engines); the validation starts a real bulletin and real fetchers as the demo does.
Modules (DESIGN.md's map): ``figures`` (every per-part figure with its source), ``model`` (the simpy model),
``validate`` (the small real run and the model at its scale), ``report`` (table, plot), ``cli`` (the command).
"""
