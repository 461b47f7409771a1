"""The request path's features (sidecar process, event loop): each a :class:`~.base.RequestFeature`
whose hooks :class:`~..proxy.Proxy` calls in the order of :func:`request_features`' list. A new
feature is one new module here and one entry in that list.
"""

from __future__ import annotations

from ..answer_versions import AnswerVersionCheck
from ..engines.registry import EngineKind
from ..routed_experts import RoutingSource
from ..salt import CacheSalter
from ..spans import SpanLedger
from .base import ModelRequest, RequestFeature, RequestUse, Verdict
from .routing import EngineRowsRouting, WorkerRouting
from .salt import CacheSalt
from .spans import SpansFeature
from .versions import VersionCheck

__all__ = ["ModelRequest", "RequestFeature", "RequestUse", "Verdict", "request_features"]


def request_features(
    kind: EngineKind,
    spans: SpanLedger,
    salter: CacheSalter,
    routing: RoutingSource | None,
    versions: AnswerVersionCheck | None,
) -> list[RequestFeature]:
    """The features of one proxy, in the order their hooks are called.

    The order matters where one feature reads what another did: the version check comes first
    (an answer that fails it is not decorated); spans parse their ask before routing replay parses
    its own and are made after it (the routing's request id is kept in front of the spans' mark);
    the engine's own routing rows come after the spans (they read the answer's spans); the cache
    salt is added last (after routing replay's own salt).

    Args:
        kind: the engine kind's descriptor.
        spans: the app's span ledger.
        salter: the app's cache salter.
        routing: the routing captured in the engine's workers (an adapter that ``ReplaysRouting``), or None.
        versions: the answer-version check (engines that report their version), or None.
    """
    features: list[RequestFeature] = []
    if versions is not None:
        features.append(VersionCheck(versions))
    features.append(SpansFeature(spans, kind.reports_versions))
    if routing is not None:
        features.append(WorkerRouting(routing))
    elif kind.engine_rows is not None:
        features.append(EngineRowsRouting(kind.engine_rows))
    features.append(CacheSalt(salter))
    return features
