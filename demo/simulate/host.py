"""One host's CPU in the fleet model, shared by its processes (runs in the operator's process: part of the model).

The OS gives the processes that have work equal shares of the host's cores, at most one core each: a process here
is one thread of execution (the bulletin's event loop; a fetch process's interpreter, whose download threads take
the interpreter lock in turn). Within a process the share is split equally among its jobs: a fetch process's
downloads interleave in small reads (httpx reads a response 64 KiB at a time), so each progresses at once. A
process that must finish one job before the next (the bulletin's event loop answers a blob GET in one turn: its
1 MiB body is one chunk) is given one job at a time by its caller (a ``simpy.Resource``). The sharing is fluid
(processor sharing), not turn by turn, so a job's cost in events is independent of its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

#: A job this close to done (seconds of its current rate) is done: float residue never schedules an empty step.
_DONE_WITHIN_S = 1e-9


@dataclass(eq=False)
class _Job:
    left_s: float
    done: simpy.Event


class Host:
    """``cores`` cores shared by the processes that have work (equal shares, at most one core each), each process's
    share split equally among its jobs."""

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        """Args:
        env: the model's environment.
        cores: cores of CPU time the host gives these processes (> 0).

        Raises:
            ValueError: ``cores`` is not positive.
        """
        if not cores > 0:
            raise ValueError(f"a host needs a positive number of cores, got {cores}")
        self.env, self.cores = env, cores
        self.jobs: dict[str, list[_Job]] = {}
        self.at = 0.0
        self.generation = 0

    def work(self, process: str, cpu_s: float) -> simpy.Event:
        """An event that fires once ``process`` has been given ``cpu_s`` seconds of CPU for this job (at once for
        ``cpu_s`` <= 0)."""
        if cpu_s <= 0:
            return self.env.timeout(0)
        self._advance()
        job = _Job(cpu_s, self.env.event())
        self.jobs.setdefault(process, []).append(job)
        self._schedule()
        return job.done

    def _rate(self, process: str) -> float:
        # CPU seconds per second each of ``process``'s jobs gets now.
        share = min(1.0, self.cores / len(self.jobs))
        return share / len(self.jobs[process])

    def _advance(self) -> None:
        elapsed = self.env.now - self.at
        if elapsed > 0:
            for process, jobs in self.jobs.items():
                rate = self._rate(process)
                for job in jobs:
                    job.left_s -= elapsed * rate
        self.at = self.env.now

    def _schedule(self) -> None:
        # The next completion under the current shares; an arrival or completion before it reschedules.
        self.generation += 1
        if not self.jobs:
            return
        wait_s = min(job.left_s / self._rate(p) for p, jobs in self.jobs.items() for job in jobs)
        timer = self.env.timeout(max(0.0, wait_s))
        generation = self.generation
        timer.callbacks.append(lambda _event: self._complete(generation))

    def _complete(self, generation: int) -> None:
        if generation != self.generation:
            return
        self._advance()
        rates = {process: self._rate(process) for process in self.jobs}
        for process, rate in rates.items():
            for job in self.jobs[process]:
                if job.left_s / rate <= _DONE_WITHIN_S:
                    job.done.succeed()
            left = [job for job in self.jobs[process] if not job.done.triggered]
            if left:
                self.jobs[process] = left
            else:
                del self.jobs[process]
        self._schedule()
