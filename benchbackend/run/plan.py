"""The matrix: workload x backend x mode x precision x replicas x threads x repeat, expanded into cells in run order.

``load_workloads`` reads the workloads named, with the command line's overrides; ``resolve``
turns the command line's ``-b``, ``--mode`` and ``--precision`` into one list of (backend, mode,
precision) choices, validated against the registry, and ``with_replicas`` repeats each choice
per ``--replicas N``; ``cells`` expands a plan into its cells, in the order they run. Nothing here
starts a process or imports a framework.

Order: by default repeats are interleaved within each workload (a comparison group): repeat r of
every backend, mode and precision runs before repeat r+1 of any (A B A B), so drift of the machine
(heat, another tenant, frequency) spreads over every backend instead of reading as a difference
between them. ``sequential`` runs all repeats of one choice before the next (A A B B).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ..backends import registry as backends
from ..backends.base import Options
from ..errors import BackendUnavailable, WorkloadError
from ..spec.loadgen import with_scenario
from ..spec.workload import Workload, load
from ..spec.workload import resolve as workload_path

ORDERS = ("interleaved", "sequential")

#: Fewer training samples per class than this, and a correct backend is not expected to clear the
#: chance check (checks.chance_accuracy): the network has too little to learn from, so a
#: chance_accuracy status would say nothing about the backend.
MIN_PER_CLASS = 10


@dataclass(frozen=True)
class Choice:
    """One (backend, mode, precision, replicas) of the matrix; ``problem`` says why it cannot run here."""

    backend: str
    mode: str
    precision: str
    problem: str = ""
    replicas: int = 1
    #: ``--threads N`` (a sweep when repeated): the cell's intra-op threads; None: every core.
    threads: Optional[int] = None
    #: ``--mode`` named this mode; False: the backend's default, which a ``--scenario`` may change
    #: (``BackendSpec.scenario_modes``).
    mode_given: bool = True


@dataclass
class RunPlan:
    workloads: list[Workload]
    choices: list[Choice]
    device: str = "cpu"
    repeats: int = 1
    data_source: str = "auto"
    data_dir: Optional[Path] = None
    parity_steps: int = 0
    inference_only: bool = False
    options: Options = field(default_factory=Options)
    order: str = "interleaved"
    #: ``--generate``: every cell generates (``run/generation.py``) instead of training and inference.
    generate: bool = False


@dataclass(frozen=True)
class GroupId:
    """All repeats of one (workload definition, backend, mode, precision, replicas): they run on one machine."""

    workload: str
    workload_hash: str
    backend: str
    mode: str
    precision: str
    replicas: int = 1
    threads: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.workload}/{self.backend}:{self.mode}/{self.precision}" + (
            f"/x{self.replicas}" if self.replicas > 1 else "") + (f"/t{self.threads}" if self.threads else "")


@dataclass(frozen=True)
class Cell:
    """One repeat of one (workload, backend, mode, precision): one worker process.

    ``order`` is its place in the plan's run order (0 first), written to the CSV."""

    workload: Workload
    choice: Choice
    repeat: int
    repeats: int
    order: int
    #: The plan sweeps batch sizes of this workload: the batch size is part of how the cell is named.
    sweep: bool = False

    @property
    def group(self) -> GroupId:
        c = self.choice
        return GroupId(self.workload.name, self.workload.hash(), c.backend, c.mode, c.precision, c.replicas,
                       c.threads)

    @property
    def comparison(self) -> str:
        """The comparison group: the cells whose timings are compared with each other (one workload
        definition); its repeats are interleaved, and on a cluster they run on one node."""
        return self.workload.hash()


def cells(plan: RunPlan) -> list[Cell]:
    """Every cell of the plan in run order (see the module docstring), ``order`` numbered from 0.
    A choice whose adapter does not build a workload's layers (``BackendSpec.builds``) carries the
    reason as its ``problem`` in that workload's cells: an ``unavailable`` row, no worker."""
    def pairs() -> Iterator[tuple[Workload, Choice, int]]:
        for w in plan.workloads:
            choices = [_buildable(w, c) for c in plan.choices]
            if plan.order == "sequential":
                yield from ((w, c, r) for c in choices for r in range(1, plan.repeats + 1))
            else:
                yield from ((w, c, r) for r in range(1, plan.repeats + 1) for c in choices)

    sizes: dict[str, set[int]] = {}
    for w in plan.workloads:
        sizes.setdefault(w.name, set()).add(w.training.batch_size)
    return [Cell(w, c, r, plan.repeats, i, sweep=len(sizes[w.name]) > 1) for i, (w, c, r) in enumerate(pairs())]


def _buildable(w: Workload, choice: Choice) -> Choice:
    """``choice``, with a ``problem`` when its backend's adapter cannot build ``w``'s network, and
    in the mode its backend names for ``w``'s scenario (``BackendSpec.scenario_modes``) unless
    ``--mode`` chose one."""
    from ..spec.model import vocabulary

    spec = backends.BACKENDS.get(choice.backend)
    scenario = w.loadgen.scenario if w.loadgen is not None else None
    if spec is not None and scenario and not choice.mode_given:  # OpenVINO's hint follows the scenario
        choice = replace(choice, mode=dict(spec.scenario_modes).get(scenario, choice.mode))
    why = "" if choice.problem or spec is None else spec.cannot_build(vocabulary(w), choice.mode)
    return replace(choice, problem=why) if why else choice


def _split(item: str) -> tuple[Optional[str], str]:
    backend, sep, rest = item.partition(":")
    return (backend, rest) if sep and backend in backends.BACKENDS else (None, item)


def load_workloads(names: tuple[str, ...], batch_sizes: tuple[int, ...], generate: Optional[dict[str, Any]] = None,
                   scenarios: Sequence[str] = (), loadgen: Optional[dict[str, Any]] = None,
                   **overrides: Any) -> list[Workload]:
    """The workloads named, with the command line's overrides, one per batch size of a sweep;
    a network that does not fit its input is a ``WorkloadError`` naming the layer. ``generate``:
    ``--generate``'s overrides (``Workload.for_generation``; a batch size of the sweep is the
    generation's batch too). ``scenarios``: ``--scenario``, one copy of each workload per scenario
    with ``loadgen``'s overrides (``spec/loadgen.py``): each scenario is its own experiment."""
    from ..spec.model import describe

    loaded = []
    for name in names:
        for b in list(dict.fromkeys(batch_sizes)) or [None]:
            w = load(name).with_overrides(batch_size=b, **overrides)
            if generate is not None:
                w = w.for_generation(batch_size=b, **generate)
            try:
                describe(w)
            except ValueError as exc:  # named by its file, as the workload's other errors are
                raise WorkloadError(f"{workload_path(name)}: {exc}") from None
            loaded.extend([with_scenario(w, s, **(loadgen or {})) for s in dict.fromkeys(scenarios)] or [w])
    return loaded


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
                if precision == "tf32" and not problem and device == "cpu":
                    problem = (f"tf32 is a math mode of NVIDIA GPUs (compute capability 8.0 or newer); --device "
                               f"{device} has none: use --precision fp32")
                if not s.accepts(device):
                    problem = f"{s.name} does not take --device {device}; it takes {', '.join(s.devices)}"
                out.append(Choice(s.name, mode, precision, problem, mode_given=bool(chosen[s.name])))
    return out


def with_replicas(choices: list[Choice], replicas: Sequence[int]) -> list[Choice]:
    """Each choice once per ``--replicas N`` (once, with 1, when none is given). N > 1 on a backend
    whose registry entry names no data-parallel adapter (``Capabilities.replicas``) is an
    ``unavailable`` choice that says so, decided here, before any worker starts."""
    out = []
    for c in choices:
        spec = backends.BACKENDS.get(c.backend)
        for n in list(dict.fromkeys(replicas)) or [1]:
            problem = c.problem
            if n > 1 and not problem and spec is not None and not spec.capabilities.replicas:
                problem = _no_replicas(spec, n)
            out.append(replace(c, replicas=n, problem=problem))
    return out


def with_threads(choices: list[Choice], threads: Sequence[int]) -> list[Choice]:
    """Each choice once per ``--threads N`` (once, with every core, when none is given). Threads are
    part of what a cell measures, as its batch size is: ``compare`` never pools two counts."""
    return [replace(c, threads=n) for c in choices for n in (list(dict.fromkeys(threads)) or [None])]


def _no_replicas(spec: backends.BackendSpec, n: int) -> str:
    """Why ``spec`` gives no cell of ``n`` replicas, naming the backends that have an engine for them."""
    having = ", ".join(name for name, s in backends.BACKENDS.items() if s.capabilities.replicas)
    why = "is not implemented for this backend yet" if spec.trains else \
        f"trains, and {spec.name} is an inference runtime"
    return f"{spec.name}: --replicas {n} (data parallel) {why}; backends with a data-parallel engine: {having}"


def size_warnings(workloads: list[Workload], limit: Optional[int], inference_only: bool) -> list[str]:
    """What the sizes of a run make doubtful, said before it starts: a ``--limit`` above a data
    set (it is capped), a batch larger than the training set (each epoch is then one smaller
    step, not the batch asked for), a training set too small for the chance check to mean anything."""
    out: list[str] = []
    for w in workloads:
        train = w.data.train
        if limit is not None and limit > train:
            out.append(f"{w.name}: --limit {limit:,} is above its {train:,} training samples; all {train:,} are used")
        if inference_only:
            continue
        if w.training.batch_size > train:
            out.append(f"{w.name}: batch size {w.training.batch_size:,} is larger than the {train:,} training samples: "
                       f"each epoch is one step of {train:,}, not a batch of {w.training.batch_size:,}")
        if train < MIN_PER_CLASS * w.num_classes and not w.next_token:  # a sequence has a label per token
            out.append(f"{w.name}: {train:,} training samples for {w.num_classes} classes (under {MIN_PER_CLASS} per "
                       "class): even a correct backend is likely to end at chance_accuracy; raise --limit")
    return list(dict.fromkeys(out))  # a batch-size sweep repeats a workload: say each thing once
