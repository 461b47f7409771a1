"""The exception tree of ``stitchboard.proto``, and what every error tree shares.

Every error names the offending tensor, key or version and says what to do. The ``type``
attribute is the name used in the wire error body (:class:`stitchboard.proto.schema.ErrorBody`),
built by :meth:`StitchError.body`; :func:`wire_types` maps those names back to the classes of
a tree, so a client can rebuild the same class from a 4xx answer::

    StitchError
    ├── SchemaError                 manifest, plan or name breaks the wire schema
    └── PatchError                  codec: a patch or checkpoint cannot be decoded or applied
        ├── PatchFormatError        not a well-formed patch / safetensors file
        ├── BaseMismatchError       tensors are not the patch's base
        ├── TargetMismatchError     bits after applying miss the target checksum (undone)
        └── TensorSetMismatchError  base and target differ in names, shapes or dtypes

The bulletin (:mod:`stitchboard.bulletin.errors`), the sidecar and the trainer client root
their own trees in :class:`StitchError`.
"""

from __future__ import annotations

from typing import Any, TypeVar

E = TypeVar("E", bound="StitchError")


class StitchError(Exception):
    """Root of every stitchboard error."""

    #: Wire name of the error (``ErrorBody.type``).
    type: str = "StitchError"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``{"type", "message", **details}`` (details must be JSON values)."""
        return {"type": self.type, "message": self.message, **self.details}


def wire_types(root: type[E]) -> dict[str, type[E]]:
    """Every class of the tree under ``root`` (``root`` included), by its wire ``type``.

    Walks the subclasses defined so far, so call it once the tree's module is imported.

    Raises:
        TypeError: two classes of the tree share a wire type (give one its own ``type``).
    """
    table: dict[str, type[E]] = {}
    pending: list[type[E]] = [root]
    while pending:
        cls = pending.pop()
        other = table.setdefault(cls.type, cls)
        if other is not cls:
            raise TypeError(
                f"{other.__qualname__} and {cls.__qualname__} both have wire type {cls.type!r}: "
                f"give each class of the {root.__qualname__} tree its own type"
            )
        pending.extend(cls.__subclasses__())
    return table


class SchemaError(StitchError, ValueError):
    """A manifest, plan or name breaks the wire schema (bad name, shape, lineage, dtype)."""

    type = "SchemaError"


class PatchError(StitchError, ValueError):
    """Root of codec errors: the patch or checkpoint cannot be decoded or applied."""

    type = "PatchError"


class PatchFormatError(PatchError):
    """The file is not a well-formed stitchboard patch or safetensors file.

    Raised for truncated files, header lengths past the end, duplicate tensor names, unknown
    dtypes, sizes that disagree with the metadata, out-of-range or unsorted indices and zstd
    frames whose declared size disagrees with the metadata. Nothing has been written when it
    is raised.
    """

    type = "PatchFormatError"


class BaseMismatchError(PatchError):
    """The tensors a patch is applied to are not the base it was made from.

    An ``xor`` patch is valid only on its exact base (it is refused on its own result too);
    an ``overwrite`` patch accepts its base or its own result. Fetch the right base version
    (or an anchor) and apply again. Nothing has been written when it is raised.
    """

    type = "BaseMismatch"


class TargetMismatchError(PatchError):
    """After applying, a tensor's bits do not match the target checksum (the write was undone)."""

    type = "TargetMismatch"


class TensorSetMismatchError(PatchError):
    """Base and target differ in tensor names, shapes or dtypes: a delta cannot express that.

    Publish an anchor (a full snapshot) instead.
    """

    type = "TensorSetMismatch"
