"""A third engine kind, living in the tests: registered through the public ``register()``, served by an unchanged
sidecar."""
