"""TRL integrations (run in the trainer process; the only place stitchboard imports ``trl``).

- ``callback`` / ``rollout``: TRL's synchronous ``GRPOTrainer`` (a ``TrainerCallback`` that publishes the
  policy's served view after each optimizer step, and a ``rollout_func`` that generates through sidecars).
- ``weight_transfer``: TRL's ``AsyncGRPOTrainer`` (a ``WeightTransferProtocol`` implementation).

See docs/integrations/trl.md and docs/integrations/trl-async.md.
"""
