"""The local executor: one cell at a time on this machine, each repeat in a fresh worker process."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..launch import run_worker

if TYPE_CHECKING:
    from ..plan import Group
    from ..runner import Runner


class LocalExecutor:
    name = "local"

    def run(self, runner: "Runner", groups: "list[Group]") -> None:
        for group in groups:
            python, env = runner.launch_args(group)
            for repeat in range(1, group.repeats + 1):
                state = runner.start(group, repeat)
                runner.progress(f"{state.tag} starting worker")
                try:
                    outcome = run_worker(python, env, runner.job(group, repeat),
                                         on_message=lambda msg: runner.message(state, msg),
                                         timeout=runner.plan.timeout, on_wait=lambda s: runner.waiting(state, s))
                except KeyboardInterrupt:
                    runner.interrupted(state)
                    raise
                cell = runner.finish(state, outcome)
                if cell.status == "unavailable":
                    break  # the other repeats would say the same
