"""The fleet routes for a :class:`~.client.BulletinClient` (its connection, token, retries and errors).

Used by the trainer SDK (:mod:`stitchboard.trainer_client.fleet`), the demo and tests; the
sidecar reports through :mod:`stitchboard.sidecar.report` (asynchronous, never retried in line).
"""

from __future__ import annotations

from stitchboard.proto.fleet import FleetCount, FleetView

from .answer_checks import check_answer
from .client import BulletinClient


class FleetClient:
    """Fleet queries of one bulletin, through ``client``.

    Raises (every method): the :mod:`stitchboard.bulletin.errors` tree, as :class:`BulletinClient`.
    """

    def __init__(self, client: BulletinClient) -> None:
        self.client = client

    def replicas(self, run: str) -> FleetView:
        """Every replica of ``run`` with its last report and liveness (MisdirectedAnswerError: another run's)."""
        what = f"listing the replicas of run {run!r}"
        r = self.client._call("GET", f"/v1/runs/{run}/replicas", what=what)
        view = FleetView.model_validate_json(r.content)
        check_answer(what, run, view.run_id)
        return view

    def count(
        self,
        run: str,
        version: int,
        *,
        min_replicas: int | None = None,
        fraction: float | None = None,
        wait_s: float = 0.0,
    ) -> FleetCount:
        """How many live replicas of ``run`` are at >= ``version``; with a requirement and ``wait_s``, the
        bulletin answers once it is met or after ``wait_s`` seconds (see :attr:`FleetCount.met`)."""
        params: dict[str, int | float] = {"version": version, "wait_s": wait_s}
        if min_replicas is not None:
            params["min_replicas"] = min_replicas
        if fraction is not None:
            params["fraction"] = fraction
        timeout = self.client.timeout_s + wait_s
        what = f"counting the replicas of run {run!r} at version {version}"
        r = self.client._call("GET", f"/v1/runs/{run}/fleet", params=params, timeout=timeout, what=what)
        count = FleetCount.model_validate_json(r.content)
        check_answer(what, run, count.run_id, version, count.version)
        return count
