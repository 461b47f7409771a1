"""Old import path of the store protocol and the folder store; they live in :mod:`stitchboard.bulletin.stores`."""

from .stores import FileStore, ObjectStat, Store, check_key, open_store

__all__ = ["FileStore", "ObjectStat", "Store", "check_key", "open_store"]
