"""Old import path of the S3 store; it lives in :mod:`stitchboard.bulletin.stores.s3`."""

from .stores.s3 import S3Settings, S3Store

__all__ = ["S3Settings", "S3Store"]
