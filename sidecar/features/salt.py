"""The cache salt as a request feature (sidecar process, event loop): see :mod:`..salt`."""

from __future__ import annotations

from ..salt import CacheSalter
from .base import ModelRequest, RequestFeature, RequestUse


class CacheSalt(RequestFeature):
    """Salts every admitted model request with its admission version (the app's :class:`~..salt.CacheSalter`)."""

    def __init__(self, salter: CacheSalter) -> None:
        self.salter = salter

    async def open(self, request: ModelRequest) -> RequestUse:
        return _Salted(self.salter)


class _Salted(RequestUse):
    def __init__(self, salter: CacheSalter) -> None:
        self.salter = salter

    def admitted(self, request: ModelRequest, start: int, claims: int) -> None:
        if self.salter.salt(request.path, request.payload, start):
            request.changed = True
        self.active = False  # nothing more to do
