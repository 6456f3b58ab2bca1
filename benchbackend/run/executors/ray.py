"""The Ray executor: the plan's cells as Ray tasks on a cluster's nodes, their messages streamed home.

Each task runs the same worker subprocess as the local executor (``launch.stream``, a fresh
process per cell, in the backend's interpreter on that node, forked from a preloaded one for CPU
cells unless ``preload`` is off) and yields the worker's messages as they arrive (a streaming
generator task, messages ``encode``d without their cell); the driver yields them to the runner,
which writes them. What runs on the node is ``ray_node.py``.

Placement is decided here, not left to Ray's queue, so that nothing waits forever for a node
that does not exist:

- by default the cells of one comparison group (one workload definition; those of one isolated
  environment apart) run in one task on one node, in the plan's order, so their repeats are
  interleaved there and like is compared with like; ``allow_mixed_hosts`` makes every cell its
  own task, on whichever node is free;
- a cell reserves a whole node's CPUs, or ``node CPUs / cells_per_node`` (its threads then default
  to that share); a cell on a GPU (``gpu``, ``cuda``, ``cuda:N``, ...) asks ``num_gpus=1``;
- a backend with an isolated environment needs the custom resource ``benchbackend-env-<name>``,
  which a node advertises (``ray start --resources '{"benchbackend-env-plaidml": 1}'``);
- a group no live node can take gets an ``unavailable`` cell that says what was missing (a node
  without CPUs takes none);
- work that no live node can take waits up to ``wait_for_nodes`` seconds for one to join (an
  autoscaler's node, or one that is starting), and asks the autoscaler for it, before its cells
  are called ``unavailable``.

A data-parallel cell (``--replicas N``) runs its replicas on N Ray Train workers, on different
nodes where there are (``ray_train.py``); a unit of them holds the cluster: it starts when nothing
else runs, and nothing else starts until it ends, so that Ray Train never waits for nodes a cell
holds (it gives up on a placement after a minute) and nothing else shares what its all-reduce crosses.

Faults cost one cell: a Ray worker or node that dies mid-cell makes that cell ``crashed`` with
Ray's reason (its streamed rows are kept), or, under ``retries``, ends that attempt ``retried``
and runs the cell again (then as attempt 2, ...); the task's remaining cells are resubmitted, to
the same node while it lives, else to another. Ray itself never retries a task (that would measure
cells twice). When the consumer stops (Ctrl-C), every task is cancelled, which kills its worker.

The data is not shipped with the cells: each node finds or makes it (``ray_node.materialize``).
Joining the cluster (or starting a local one) is ``ray_join.py``.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..messages import Ended, Message, Outcome, Started, decode
from .ray_join import join
from .ray_node import ENV_RESOURCE, DataSource, alive_nodes, cell_task, missing, needs
from .ray_train import replica_cpus, start_replicas, too_few, unsupported

if TYPE_CHECKING:
    from ..plan import Cell, GroupId
    from ..runner import Task

_POLL_S = 0.5
_CANCEL_GRACE_S = 10.0
#: The node of a running data-parallel unit: it holds every node (see the module docstring).
_CLUSTER = "*"


@dataclass
class _Work:
    """Cells that run in one task on one node, in order."""

    tasks: list["Task"]
    node: Optional[str] = None  # the node the work is pinned to, once it has run there
    waiting_since: Optional[float] = None  # since when no live node could take it (``wait_for_nodes``)

    @property
    def needs(self) -> dict[str, float]:
        return needs(self.tasks[0])

    @property
    def replicas(self) -> int:
        return self.tasks[0].cell.choice.replicas


@dataclass
class _Running:
    work: _Work
    node: str
    gen: Any  # ray.ObjectRefGenerator
    current: Optional["Cell"] = None
    done: set[int] = field(default_factory=set)


class RayExecutor:
    """Runs cells as Ray tasks; see the module docstring. ``address=None`` starts a local cluster."""

    #: Cells run on the cluster's nodes: what is installed on the driver says nothing about them
    #: (a node without the backend answers with an ``unavailable`` row from its worker).
    remote = True

    def __init__(self, address: Optional[str] = None, cells_per_node: Optional[int] = None,
                 allow_mixed_hosts: bool = False, num_cpus: Optional[int] = None, timeout: Optional[float] = None,
                 wait_for_nodes: float = 0.0, retries: int = 0, preload: bool = True):
        if cells_per_node is not None and cells_per_node < 1:
            raise ValueError("cells_per_node must be at least 1")
        if wait_for_nodes < 0 or retries < 0:
            raise ValueError("wait_for_nodes and retries cannot be negative")
        self.wait_for_nodes, self.retries, self.preload = wait_for_nodes, retries, preload
        self.address = address
        self.cells_per_node = cells_per_node
        self.allow_mixed_hosts = allow_mixed_hosts
        self.num_cpus = num_cpus  # of the local cluster only (None: all cores)
        self.timeout = timeout
        self._owned = False  # whether this executor started or joined Ray (and so shuts it down)

    def run(self, tasks: Sequence["Task"]) -> Iterator[Message]:
        self.connect()
        try:
            yield from _Session(self, tasks).messages()
        finally:
            if self._owned:
                ray.shutdown()
                self._owned = False

    def connect(self) -> None:
        """Join ``address`` or start a local cluster, unless this process is already connected.

        The CLI may call it before preparing data, to fail fast. Raises ``ClusterError`` when the
        address cannot be reached (``ray.init`` itself would retry for minutes) or Ray fails to start.
        """
        if join(self.address, self.num_cpus):
            self._owned = True


def _units(tasks: Sequence["Task"], mixed: bool) -> list[_Work]:
    """The work units in plan order: one per cell with mixed hosts allowed, else one per comparison
    group, set of needs and replicas (a group's cells in an isolated environment form their own unit)."""
    if mixed:
        return [_Work([t]) for t in tasks]
    units: dict[tuple[str, tuple, int], _Work] = {}
    for t in tasks:
        key = (t.cell.comparison, tuple(sorted(needs(t).items())), t.cell.choice.replicas)
        units.setdefault(key, _Work([])).tasks.append(t)
    return list(units.values())


class _Session:
    """One executor run: the queue of work, the running tasks, the cells they report on."""

    def __init__(self, executor: RayExecutor, tasks: Sequence["Task"]):
        self.ex = executor
        self.cells = {t.cell.order: t.cell for t in tasks}
        self.pending: deque[_Work] = deque(_units(tasks, executor.allow_mixed_hosts))
        self.running: dict[Any, _Running] = {}
        self.data: dict[str, DataSource] = {}
        self.given_up: set["GroupId"] = set()  # groups that came back unavailable
        self.retried: dict[int, int] = {}  # cell order -> attempts run again
        self.asked = False  # whether the autoscaler was asked for nodes

    def messages(self) -> Iterator[Message]:
        finished = False
        try:
            while self.pending or self.running:
                if self.pending:
                    yield from self._submit(alive_nodes())
                if not self.running:
                    time.sleep(_POLL_S)  # every node that can take the next work is busy elsewhere
                    continue
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=_POLL_S)
                for gen in ready:
                    yield from self._step(self.running[gen])
            finished = True
        finally:
            if not finished:  # Ctrl-C or a consumer that stopped: no task outlives the run
                self._cancel_all()
            if self.asked:
                _ask_autoscaler([])  # withdraw the request: the nodes may go

    # --- placement ----------------------------------------------------------------------------
    def _submit(self, nodes: list[dict[str, Any]]) -> Iterator[Message]:
        busy: dict[str, int] = {}
        for task in self.running.values():
            busy[task.node] = busy.get(task.node, 0) + 1
        slots = self.ex.cells_per_node or 1
        waiting: deque[_Work] = deque()
        while self.pending and _CLUSTER not in busy:
            work = self.pending.popleft()
            work.tasks = [t for t in work.tasks if t.cell.group not in self.given_up]
            if not work.tasks:
                continue
            if work.replicas > 1:
                if busy:  # it waits for the cluster, and everything after it waits for it
                    waiting.append(work)
                    break
                yield from self._replicas(work, nodes, waiting, busy)
                continue
            fit = [n for n in nodes if not missing(work.needs, n)]
            if work.node and any(n["NodeID"] == work.node for n in fit):
                fit = [n for n in fit if n["NodeID"] == work.node]  # the work stays where it began
            if not fit:
                if self._may_wait(work):
                    waiting.append(work)
                else:
                    yield from self._unavailable(work, nodes)
                continue
            work.waiting_since = None
            free = [n for n in fit if busy.get(n["NodeID"], 0) < slots]
            if not free:
                waiting.append(work)
                continue
            node = free[0]
            busy[node["NodeID"]] = busy.get(node["NodeID"], 0) + 1
            self._launch(work, node)
        waiting.extend(self.pending)
        self.pending = waiting

    def _replicas(self, work: _Work, nodes: list[dict[str, Any]], waiting: deque[_Work],
                  busy: dict[str, int]) -> Iterator[Message]:
        """Start a data-parallel unit (``ray_train``), which then holds the cluster, or say why it cannot run."""
        for task in work.tasks:  # a backend whose engine Ray Train cannot start
            if unsupported(task):
                yield from self._unavailable(_Work([task]), nodes, unsupported(task))
        work.tasks = [t for t in work.tasks if t.cell.group not in self.given_up]
        cpus = replica_cpus(nodes, work.replicas, work.needs, self.ex.cells_per_node)
        if not work.tasks:
            return
        if cpus is None and self._may_wait(work):
            waiting.append(work)
        elif cpus is None:
            yield from self._unavailable(work, nodes, too_few(nodes, work.replicas, work.needs))
        else:
            work.waiting_since = None
            gen = start_replicas(work.tasks, self._data(work), cpus, work.needs, self.ex.timeout)
            self.running[gen] = _Running(work, _CLUSTER, gen)
            busy[_CLUSTER] = 1

    def _may_wait(self, work: _Work) -> bool:
        """Whether ``work``, which no live node can take, waits on for a node to join (and asks the
        autoscaler for one the first time)."""
        if not self.ex.wait_for_nodes:
            return False
        now = time.monotonic()
        if work.waiting_since is None:
            work.waiting_since = now
            self.asked = True
            _ask_autoscaler([{"CPU": 1.0, **work.needs}])
        return now - work.waiting_since < self.ex.wait_for_nodes

    def _cpus(self, node: Mapping[str, Any]) -> float:
        total = float(node["Resources"].get("CPU", 0))
        share = total / (self.ex.cells_per_node or 1)
        return float(int(share)) if share >= 1 else round(share, 4)  # Ray takes whole numbers above 1

    def _launch(self, work: _Work, node: Mapping[str, Any]) -> None:
        resources = dict(work.needs)
        cpus = self._cpus(node)
        # Adapters size their own pools from the option, OpenMP/MKL from the env.
        share = int(cpus) if self.ex.cells_per_node and cpus >= 1 else None
        options: dict[str, Any] = {
            "num_cpus": cpus, "num_gpus": resources.pop("GPU", 0), "resources": resources, "max_retries": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
        gen = cell_task.options(**options).remote(work.tasks, self._data(work), share, self.ex.timeout,
                                                  self.ex.preload)
        work.node = node["NodeID"]
        self.running[gen] = _Running(work, node["NodeID"], gen)

    def _data(self, work: _Work) -> DataSource:
        """Where a node finds the unit's arrays (``ray_node.materialize``). The driver's copy goes
        into the object store once: a node pulls it only when it can neither make nor see them."""
        first = work.tasks[0]
        path = first.job.data
        if path not in self.data:
            self.data[path] = DataSource(first.data_sha256, path,
                                         first.cell.workload if first.data_source == "synthetic" else None,
                                         [ray.put(Path(path).read_bytes())])
        return self.data[path]

    def _unavailable(self, work: _Work, nodes: list[dict[str, Any]], why: str = "") -> Iterator[Message]:
        lacking = sorted({m for n in nodes for m in missing(work.needs, n)} or ["CPU", *work.needs])
        hint = "".join(f"; advertise it with `ray start --resources '{{\"{m}\": 1}}'` on a node that has run "
                       f"`benchbackend setup {m.removeprefix(ENV_RESOURCE.format(''))}`"
                       for m in lacking if m.startswith(ENV_RESOURCE.format("")))
        waited = f" (after waiting {self.ex.wait_for_nodes:g}s for nodes to join)" if self.ex.wait_for_nodes else ""
        outcome = Outcome("unavailable", why + waited if why else f"no live node of the Ray cluster ({len(nodes)} "
                                                                 f"nodes) has {', '.join(lacking)}{waited}{hint}")
        for task in work.tasks:
            if task.cell.group not in self.given_up:
                self.given_up.add(task.cell.group)
                yield Started(task.cell)
                yield Ended(task.cell, outcome)

    # --- messages -----------------------------------------------------------------------------
    def _step(self, task: _Running) -> Iterator[Message]:
        try:
            ref = next(task.gen)
        except StopIteration:
            del self.running[task.gen]
            if task.current is not None:  # the stream ended inside a cell without an error: never expected
                yield Ended(task.current, Outcome("crashed", "the Ray task ended before its worker did"))
            return
        try:
            message = decode(ray.get(ref), self.cells)
        except RayError as exc:
            yield from self._fault(task, exc)
            return
        if isinstance(message, Started):
            task.current = message.cell
        elif isinstance(message, Ended):
            task.current = None
            task.done.add(message.cell.order)
            if message.outcome.status == "unavailable":
                self.given_up.add(message.cell.group)
        yield message

    def _fault(self, task: _Running, exc: RayError) -> Iterator[Message]:
        """The task's worker or node died: the running cell is crashed, or ``retried`` while it has
        retries left; the rest of the work (with a retried cell) goes on, on another node if need be."""
        reason = _reason(exc)
        del self.running[task.gen]
        cell = task.current
        if cell is not None:
            tried = self.retried.get(cell.order, 0)
            if tried < self.ex.retries:
                self.retried[cell.order] = tried + 1
                yield Ended(cell, Outcome("retried", f"Ray: {reason}; run again (retry {tried + 1} of "
                                                     f"{self.ex.retries})"))
            else:
                task.done.add(cell.order)
                after = f" (after {tried} retries)" if tried else ""
                yield Ended(cell, Outcome("crashed", f"Ray: {reason}{after}"))
        rest = [t for t in task.work.tasks if t.cell.order not in task.done]
        if rest:
            self.pending.appendleft(_Work(rest, task.node))

    def _cancel_all(self) -> None:
        """Every task is cancelled (KeyboardInterrupt in the task: it kills its worker process)."""
        self.pending.clear()
        gens = list(self.running)
        for gen in gens:
            ray.cancel(gen)
        deadline = time.monotonic() + _CANCEL_GRACE_S
        while gens and time.monotonic() < deadline:
            ready, gens = ray.wait(gens, num_returns=1, timeout=0.5)
            for gen in ready:
                try:
                    next(gen)
                    gens.append(gen)  # a message after the interrupt: dropped, keep draining
                except StopIteration:
                    pass
        for gen in gens:
            ray.cancel(gen, force=True)


def _reason(exc: RayError) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}"[:400]


def _ask_autoscaler(bundles: list[dict[str, float]]) -> None:
    """Ask the cluster's autoscaler for nodes that fit ``bundles`` (``[]`` withdraws the request).
    Without an autoscaler it is a note nobody reads; it never fails a run."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
    except Exception:  # noqa: BLE001 - an optional courtesy to the autoscaler
        logging.getLogger(__name__).debug("request_resources failed", exc_info=True)
