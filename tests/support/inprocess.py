"""An executor for tests: each cell's job runs in the test process (``worker.run_job``), not in a
worker process of its own.

For tests of what the runner and the CLI do with a cell's messages (statuses, rows, exit codes,
the summary) when the fresh process is not what they test: a framework is imported once per test
process instead of once per cell, which is most of a small cell's cost. The messages go through
the launcher's own parser, so the runner sees exactly what a real worker's JSON lines give it.
"""
from __future__ import annotations

import json
import traceback
from typing import Any, Iterator, Sequence

from benchbackend.run import launch, worker
from benchbackend.run.messages import Ended, Message, Started
from benchbackend.run.runner import Task


class InProcessExecutor:
    remote = False

    def run(self, tasks: Sequence[Task]) -> Iterator[Message]:
        given_up = set()
        for task in tasks:
            if task.cell.group in given_up:
                continue
            yield Started(task.cell)
            lines: list[str] = []
            state = launch._State()
            try:
                worker.run_job(task.job, lambda m: lines.append(json.dumps(m, default=float)))
                state.ended = True
            except Exception as exc:  # as the worker's main does: an error message, then exit 1
                lines.append(json.dumps({"type": "error", "message": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()}))
                state.ended = True
            for line in lines:
                message = launch._parse(task.cell, line, state)
                if message is not None:
                    yield message
            outcome = state.outcome(1 if state.error else 0, None, "")
            yield Ended(task.cell, outcome)
            if outcome.status == "unavailable":
                given_up.add(task.cell.group)


def use(monkeypatch) -> None:
    """Make ``benchbackend run`` (through click's CliRunner) run its cells in this process."""
    from benchbackend.run import executors

    monkeypatch.setattr(executors, "make", lambda *args, **kwargs: InProcessExecutor())


def run_with(spec: Any, args: Sequence[str]) -> Any:
    """``benchbackend run ARGS`` through click's CliRunner, its cells in this process, with the
    test-only backend ``spec`` registered for the call only (module-scoped fixtures, which cannot
    take pytest's function-scoped ``monkeypatch``)."""
    import pytest
    from click.testing import CliRunner

    from benchbackend.backends import registry
    from benchbackend.cli import main

    mp = pytest.MonkeyPatch()
    try:
        mp.setitem(registry.BACKENDS, spec.name, spec)
        use(mp)
        return CliRunner().invoke(main, ["run", *args])
    finally:
        mp.undo()
