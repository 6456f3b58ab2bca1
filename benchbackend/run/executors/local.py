"""The local executor: one cell at a time on this machine, each in a fresh worker process (forked,
for CPU cells, from a process that has imported the backend already: ``preload.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from ..launch import python_for, stream, worker_environ
from ..messages import Ended, Message, Started
from ..preload import Preloaders

if TYPE_CHECKING:
    from ..plan import GroupId
    from ..runner import Task


class LocalExecutor:
    """Runs the tasks in their order. A group whose cell came back ``unavailable`` runs no more
    cells (its other repeats would say the same). Stopping the iteration (Ctrl-C) kills the worker."""

    remote = False

    def __init__(self, timeout: Optional[float] = None, preload: bool = True):
        self.timeout, self.preload = timeout, preload

    def run(self, tasks: Sequence["Task"]) -> Iterator[Message]:
        given_up: set["GroupId"] = set()
        with Preloaders() as preloaders:
            for task in tasks:
                if task.cell.group in given_up:
                    continue
                job = task.job
                python, env = python_for(task.spec), worker_environ(task.spec, job.device, job.options.threads)
                forked = preloaders if self.preload and job.device == "cpu" else None
                yield Started(task.cell)
                outcome = yield from stream(task.cell, python, env, job, self.timeout, preloaders=forked)
                yield Ended(task.cell, outcome)
                if outcome.status == "unavailable":
                    given_up.add(task.cell.group)
