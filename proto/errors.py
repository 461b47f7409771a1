"""The exception tree of ``stitchboard.proto``.

Every error names the offending tensor, key or version and says what to do. The ``type``
attribute is the name used in the wire error body (:class:`stitchboard.proto.schema.ErrorBody`),
so a client can map a 4xx answer back to the same class.
"""

from __future__ import annotations


class StitchError(Exception):
    """Root of every stitchboard error."""

    #: Wire name of the error (``ErrorBody.type``).
    type: str = "StitchError"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


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
