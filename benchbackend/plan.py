"""The matrix: workload x backend x mode x precision x repeat, expanded into cells.

``resolve`` turns the command line's ``-b``, ``--mode`` and ``--precision`` into one list of
(backend, mode, precision) choices, validated against the registry; ``cells`` expands a plan.
Nothing here starts a process or imports a framework.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import backends
from .errors import BackendUnavailable
from .workload import Workload


@dataclass(frozen=True)
class Choice:
    """One (backend, mode, precision) of the matrix; ``problem`` says why it cannot run here."""

    backend: str
    mode: str
    precision: str
    problem: str = ""


@dataclass
class RunPlan:
    workloads: list[Workload]
    choices: list[Choice]
    device: str = "cpu"
    repeats: int = 1
    timeout: Optional[float] = None
    data_source: str = "auto"
    data_dir: Optional[Path] = None
    parity_steps: int = 0
    inference_only: bool = False
    #: Run options the adapters may use: threads, steps_per_execution, tune_trials.
    options: dict[str, Any] = field(default_factory=dict)
    output: Path = Path("results/run.csv")


@dataclass(frozen=True)
class Group:
    """All repeats of one (workload, backend, mode, precision): they run on one machine."""

    workload: Workload
    choice: Choice
    repeats: int

    @property
    def key(self) -> str:
        c = self.choice
        return f"{self.workload.name}/{c.backend}:{c.mode}/{c.precision}"


def _split(item: str) -> tuple[Optional[str], str]:
    backend, sep, rest = item.partition(":")
    return (backend, rest) if sep and backend in backends.BACKENDS else (None, item)


def resolve(names: list[str], modes: list[str], precisions: list[str], device: str = "cpu") -> list[Choice]:
    """Validate ``-b``/``--mode``/``--precision`` and return the (backend, mode, precision) choices.

    ``--mode`` takes ``backend:mode`` or a bare mode name that applies to every chosen backend that
    has it; a backend no ``--mode`` names runs its default mode. ``--precision`` takes ``fp32`` etc.
    (for every backend that has it; the others get an ``unavailable`` choice) or ``backend:precision``.
    Raises ``BackendUnavailable`` naming the allowed values for an unknown backend, mode or precision.
    """
    specs = [backends.get(n) for n in names]
    chosen: dict[str, list[str]] = {s.name: [] for s in specs}
    for item in modes:
        backend, mode = _split(item)
        targets = [backends.BACKENDS[backend]] if backend else [s for s in specs if mode in s.mode_names]
        if backend and backend not in chosen:
            raise BackendUnavailable(f"--mode {item}: backend '{backend}' is not among the backends of this run "
                                     f"({', '.join(chosen)}); add -b {backend}")
        if not targets or mode not in targets[0].mode_names:
            allowed = "; ".join(f"{s.name}: {', '.join(s.mode_names)}" for s in (targets or specs))
            raise BackendUnavailable(f"unknown mode '{item}'; modes are {allowed}")
        for s in targets:
            if mode not in chosen[s.name]:
                chosen[s.name].append(mode)
    wanted_precisions: dict[str, list[str]] = {s.name: [] for s in specs}
    for item in precisions or ["fp32"]:
        backend, precision = _split(item)
        targets = [backends.BACKENDS[backend]] if backend else specs
        if backend and backend not in chosen:
            raise BackendUnavailable(f"--precision {item}: backend '{backend}' is not among the backends of this run")
        if not any(precision in s.precisions for s in targets):
            allowed = "; ".join(f"{s.name}: {', '.join(s.precisions)}" for s in targets)
            raise BackendUnavailable(f"unknown precision '{item}'; precisions are {allowed}")
        for s in targets:
            if precision not in wanted_precisions[s.name]:
                wanted_precisions[s.name].append(precision)
    if not any(s.accepts(device) for s in specs):
        forms = "; ".join(f"{s.name}: {', '.join(s.devices)}" for s in specs)
        raise BackendUnavailable(f"--device {device!r} is not a device these backends accept ({forms})")
    out = []
    for s in specs:
        for mode in chosen[s.name] or [s.default_mode]:
            for precision in wanted_precisions[s.name]:
                problem = "" if precision in s.precisions else (
                    f"{s.name} has no precision {precision}; it has {', '.join(s.precisions)}")
                if not s.accepts(device):
                    problem = f"{s.name} does not take --device {device}; it takes {', '.join(s.devices)}"
                out.append(Choice(s.name, mode, precision, problem))
    return out


def groups(plan: RunPlan) -> list[Group]:
    """The plan's groups in run order: workload-major, then backend, mode, precision."""
    return [Group(w, c, plan.repeats) for w in plan.workloads for c in plan.choices]
