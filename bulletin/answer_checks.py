"""What a bulletin client checks on every answer before using it: that it is for the run and
version asked (runs in every client process: trainer, sidecar, CLI).

A bulletin, or a proxy or ingress in front of it, that answers run ``s``'s requests with run
``t``'s objects must not make a sidecar of ``s`` load ``t``'s weights and stamp answers with
``s``'s versions. Blobs are content-addressed and hashed on arrival; these checks do the same
for the answers that name a run and a version: manifests, plans (every step's lineage too),
squash records, latest and long-poll answers, version lists and fleet answers. A mismatch
raises :class:`~.errors.MisdirectedAnswerError` naming both; nothing of the answer is used.
"""

from __future__ import annotations

from stitchboard.proto.schema import Plan

from .errors import MisdirectedAnswerError


def check_answer(
    what: str, run: str, answer_run: str, version: int | None = None, answer_version: int | None = None
) -> None:
    """Refuse an answer for another run (or, when ``version`` is given, another version).

    Args:
        what: the request, for the message (e.g. ``"reading version 3 of run 'a'"``).
        run: the run asked for; ``answer_run``: the run the answer names.
        version: the version asked for (None: any); ``answer_version``: the version the answer names.

    Raises:
        MisdirectedAnswerError: the run or the version differs.
    """
    if answer_run == run and (version is None or answer_version == version):
        return
    asked = f"run {run!r}" + ("" if version is None else f" version {version}")
    got = f"run {answer_run!r}" + ("" if answer_version is None else f" version {answer_version}")
    raise MisdirectedAnswerError(
        f"{what}: asked for {asked}, the answer is for {got}; the bulletin URL, or a proxy or ingress in front "
        "of it, routes this run's requests elsewhere: fix the routing (nothing of the answer was used)",
        run_id=run,
        version=version,
        answer_run_id=answer_run,
        answer_version=answer_version,
    )


def check_newer(what: str, run: str, answer_run: str, after: int, answer_version: int) -> None:
    """Refuse a latest or long-poll answer for another run, or not newer than ``after``.

    Raises:
        MisdirectedAnswerError: the run differs, or ``answer_version <= after``.
    """
    check_answer(what, run, answer_run)
    if answer_version <= after:
        raise MisdirectedAnswerError(
            f"{what}: asked for a version of run {run!r} newer than {after}, the answer is version "
            f"{answer_version}; the bulletin URL, or a proxy or cache in front of it, answers with stale or other "
            "data: fix the routing or the cache (nothing of the answer was used)",
            run_id=run,
            version=after + 1,
            answer_run_id=answer_run,
            answer_version=answer_version,
        )


def check_plan(what: str, plan: Plan, run: str, from_version: int | None, to_version: int | None) -> None:
    """Refuse a plan for another run or route: its run, start and end must be the ones asked
    (``to_version`` None: any end), and its steps must chain from the start to the end (a delta
    from the previous step's version + 1, a squash from the previous step's version, a snapshot
    past it; the last step at the end).

    Raises:
        MisdirectedAnswerError: naming what differs.
    """
    check_answer(what, run, plan.run_id)
    if plan.from_version != from_version:
        check_answer(what + " (its start)", run, plan.run_id, from_version, plan.from_version)
    if to_version is not None and plan.to_version != to_version:
        check_answer(what + " (its end)", run, plan.run_id, to_version, plan.to_version)
    held = from_version
    for i, step in enumerate(plan.steps):
        chained = (
            (step.kind == "delta" and held is not None and step.version == held + 1)
            or (step.kind == "squash" and step.base_version == held)
            or (step.kind == "snapshot" and (held is None or step.version > held))
        )
        if not chained:
            raise MisdirectedAnswerError(
                f"{what}: step {i + 1} ({step.kind} to version {step.version}) does not follow version {held}: the "
                "plan is not a route from the version asked; the bulletin URL, or a proxy in front of it, answers "
                "with another run's or store's plan: fix the routing (nothing of the plan was used)",
                run_id=run,
                version=held,
                answer_run_id=plan.run_id,
                answer_version=step.version,
            )
        held = step.version
    if plan.steps and held != plan.to_version:
        check_answer(what + " (its last step)", run, plan.run_id, plan.to_version, held)
