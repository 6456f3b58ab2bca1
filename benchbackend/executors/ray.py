"""The Ray executor: the plan's cells as Ray tasks on a cluster's nodes, rows streamed home.

Each task runs the same worker subprocess as the local executor (``launch.run_worker``, a fresh
process per repeat, in the backend's interpreter on that node) and yields the worker's messages as
they arrive (a streaming generator task); the driver hands them to the runner, which writes them.

Placement is decided here, not left to Ray's queue, so that nothing waits forever for a node
that does not exist:

- by default all repeats of a group run in one task on one node, one after the other (like with
  like); ``allow_mixed_hosts`` makes every repeat its own task, on whichever node is free;
- a cell reserves a whole node's CPUs, or ``node CPUs / cells_per_node`` (its threads then default
  to that share); ``--device gpu`` asks ``num_gpus=1``;
- a backend with an isolated environment needs the custom resource ``benchbackend-env-<name>``,
  which a node advertises (``ray start --resources '{"benchbackend-env-plaidml": 1}'``);
- a group no live node can take gets an ``unavailable`` cell that says what was missing.

Faults cost one cell: a Ray worker or node that dies mid-cell makes that cell ``crashed`` with
Ray's reason (its streamed rows are kept); the group's remaining repeats are resubmitted, to the
same node while it lives. Tasks are never retried by Ray (a retry would measure a cell twice).
Ctrl-C cancels every task, marks the running cells ``interrupted`` and re-raises.
"""
from __future__ import annotations

import logging
import queue
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import backends
from ..errors import ClusterError
from ..launch import HEARTBEAT_S, Outcome, run_worker

if TYPE_CHECKING:
    from ..plan import Group
    from ..runner import CellState, Runner

ENV_RESOURCE = "benchbackend-env-{}"
#: How much of a node's ``benchbackend-env-*`` resource a cell takes: a marker, not a limit.
ENV_SHARE = 0.001
_POLL_S = 0.5
_CONNECT_TIMEOUT_S = 10.0
_CANCEL_GRACE_S = 10.0


def local_resources() -> dict[str, float]:
    """The custom resources this machine advertises: one per isolated environment ready here."""
    from .. import envs

    return {ENV_RESOURCE.format(name): 1.0 for name in backends.isolated_envs() if envs.is_ready(name)}


@dataclass
class _Work:
    """Repeats of one group that must run in one task (one repeat with mixed hosts allowed)."""

    group: "Group"
    repeats: list[int]
    node: Optional[str] = None  # the node the group is pinned to, once it has run there


@dataclass
class _Task:
    work: _Work
    node: str
    gen: Any  # ray.ObjectRefGenerator
    state: Optional["CellState"] = None
    done: list[int] = field(default_factory=list)
    unavailable: bool = False


class RayExecutor:
    """Runs groups as Ray tasks; see the module docstring. ``address=None`` starts a local cluster."""

    name = "ray"
    #: Cells run on the cluster's nodes: what is installed on the driver says nothing about them
    #: (a node without the backend answers with an ``unavailable`` row from its worker).
    remote = True

    def __init__(self, address: Optional[str] = None, cells_per_node: Optional[int] = None,
                 allow_mixed_hosts: bool = False, num_cpus: Optional[int] = None):
        if cells_per_node is not None and cells_per_node < 1:
            raise ValueError("cells_per_node must be at least 1")
        self.address = address
        self.cells_per_node = cells_per_node
        self.allow_mixed_hosts = allow_mixed_hosts
        self.num_cpus = num_cpus  # of the local cluster only (None: all cores)
        self._owned = False  # whether this executor started or joined Ray (and so shuts it down)

    def run(self, runner: "Runner", groups: "list[Group]") -> None:
        self.connect()
        try:
            _Session(self, runner).run(groups)
        finally:
            if self._owned:
                ray.shutdown()
                self._owned = False

    def connect(self) -> None:
        """Join ``address`` or start a local cluster, unless this process is already connected.

        The CLI may call it before preparing data, to fail fast. Raises ``ClusterError`` when the
        address cannot be reached (``ray.init`` itself would retry for minutes) or Ray fails to start.
        """
        if self.address:
            _check_reachable(self.address)
        if ray.is_initialized():
            return
        quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "include_dashboard": False}
        try:
            if self.address:
                ray.init(address=self.address, **quiet)
            else:
                ray.init(num_cpus=self.num_cpus, resources=local_resources(), **quiet)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
            where = f"the Ray cluster at {self.address}" if self.address else "a local Ray cluster"
            raise ClusterError(f"cannot join {where}: {str(exc).strip().splitlines()[0]}") from None
        self._owned = True


def _check_reachable(address: str) -> None:
    if address == "auto" or "://" in address:
        return  # ray.init resolves these itself
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--address {address}: expected HOST:PORT (the head node's GCS port, 6379 by default)")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} "
                           f"(is `ray start --head` running there?)") from None


class _Session:
    """One executor run: the queue of work, the running tasks, the runner they report to."""

    def __init__(self, executor: RayExecutor, runner: "Runner"):
        self.ex = executor
        self.runner = runner
        self.pending: deque[_Work] = deque()
        self.running: dict[Any, _Task] = {}
        self.data: dict[str, Any] = {}
        self.given_up: set[str] = set()  # group keys that came back unavailable

    def run(self, groups: "list[Group]") -> None:
        for g in groups:
            if self.ex.allow_mixed_hosts:
                self.pending.extend(_Work(g, [r]) for r in range(1, g.repeats + 1))
            else:
                self.pending.append(_Work(g, list(range(1, g.repeats + 1))))
        try:
            while self.pending or self.running:
                if self.pending:
                    self._submit(_alive_nodes())
                if not self.running:
                    time.sleep(_POLL_S)  # every node that can take the next work is busy elsewhere
                    continue
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=_POLL_S)
                for gen in ready:
                    self._step(self.running[gen])
        except KeyboardInterrupt:
            self._cancel_all()
            raise

    # --- placement ----------------------------------------------------------------------------
    def _submit(self, nodes: list[dict[str, Any]]) -> None:
        busy: dict[str, int] = {}
        for task in self.running.values():
            busy[task.node] = busy.get(task.node, 0) + 1
        slots = self.ex.cells_per_node or 1
        waiting: deque[_Work] = deque()
        while self.pending:
            work = self.pending.popleft()
            if work.group.key in self.given_up:
                continue
            fit = [n for n in nodes if not _missing(self._needs(work.group), n)]
            if work.node and any(n["NodeID"] == work.node for n in fit):
                fit = [n for n in fit if n["NodeID"] == work.node]  # the group stays where it began
            if not fit:
                self._unavailable(work, nodes)
                continue
            free = [n for n in fit if busy.get(n["NodeID"], 0) < slots]
            if not free:
                waiting.append(work)
                continue
            node = free[0]
            busy[node["NodeID"]] = busy.get(node["NodeID"], 0) + 1
            self._launch(work, node)
        self.pending = waiting

    def _needs(self, group: "Group") -> dict[str, float]:
        spec = backends.get(group.choice.backend)
        needs = {"GPU": 1.0} if self.runner.plan.device == "gpu" else {}
        if spec.isolated_env:
            needs[ENV_RESOURCE.format(spec.isolated_env)] = ENV_SHARE
        return needs

    def _cpus(self, node: Mapping[str, Any]) -> float:
        total = float(node["Resources"].get("CPU", 0))
        share = total / (self.ex.cells_per_node or 1)
        return float(int(share)) if share >= 1 else round(share, 4)  # Ray takes whole numbers above 1

    def _launch(self, work: _Work, node: Mapping[str, Any]) -> None:
        group, runner = work.group, self.runner
        spec = backends.get(group.choice.backend)
        needs = self._needs(group)
        cpus = self._cpus(node)
        threads = runner.plan.options.get("threads") or (int(cpus) if self.ex.cells_per_node and cpus >= 1 else None)
        jobs = [runner.job(group, r) for r in work.repeats]
        for job in jobs:  # adapters size their own pools from the option, OpenMP/MKL from the env
            job["options"] = {**job["options"], "threads": threads}
        options: dict[str, Any] = {
            "num_cpus": cpus, "num_gpus": needs.pop("GPU", 0), "resources": needs, "max_retries": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
        gen = _cell_task.options(**options).remote(spec, jobs, self._data(group), runner.plan.device, threads,
                                                   runner.plan.timeout)
        work.node = node["NodeID"]
        self.running[gen] = _Task(work, node["NodeID"], gen)

    def _data(self, group: "Group") -> Any:
        """The workload's arrays in the object store, put once: nodes cannot read the driver's files."""
        key = group.workload.hash()
        if key not in self.data:
            self.data[key] = ray.put(Path(self.runner.npz[key]).read_bytes())
        return self.data[key]

    def _unavailable(self, work: _Work, nodes: list[dict[str, Any]]) -> None:
        needs = self._needs(work.group)
        missing = sorted({m for n in nodes for m in _missing(needs, n)} or needs)
        hint = "".join(f"; advertise it with `ray start --resources '{{\"{m}\": 1}}'` on a node that has run "
                       f"`benchbackend setup {m.removeprefix(ENV_RESOURCE.format(''))}`"
                       for m in missing if m.startswith(ENV_RESOURCE.format("")))
        state = self.runner.start(work.group, work.repeats[0])
        self.runner.finish(state, Outcome("unavailable", f"no live node of the Ray cluster ({len(nodes)} nodes) "
                                                         f"has {', '.join(missing)}{hint}"))
        self.given_up.add(work.group.key)

    # --- messages -----------------------------------------------------------------------------
    def _step(self, task: _Task) -> None:
        try:
            ref = next(task.gen)
        except StopIteration:
            self._ended(task)
            return
        try:
            kind, payload = ray.get(ref)
        except RayError as exc:
            self._fault(task, exc)
            return
        runner = self.runner
        if kind == "start":
            task.state = state = runner.start(task.work.group, payload["repeat"])
            state.base.update(payload["environment"])  # the node's host, os, cpu until the worker says
            runner.progress(f"{state.tag} starting worker on {payload['environment']['host']}")
        elif kind == "message" and task.state is not None:
            runner.message(task.state, payload)
        elif kind == "wait" and task.state is not None:
            runner.waiting(task.state, payload)
        elif kind == "end" and task.state is not None:
            cell = runner.finish(task.state, Outcome(payload["status"], payload["message"]))
            task.done.append(cell.repeat)
            task.state = None
            if cell.status == "unavailable":
                task.unavailable = True
                self.given_up.add(task.work.group.key)

    def _ended(self, task: _Task) -> None:
        del self.running[task.gen]
        if task.state is not None:  # the stream ended inside a cell without an error: never expected
            self.runner.finish(task.state, Outcome("crashed", "the Ray task ended before its worker did"))
            task.done.append(task.state.cell.repeat)

    def _fault(self, task: _Task, exc: RayError) -> None:
        """The task's worker or node died: the running cell is crashed, the rest of the group goes on."""
        reason = _reason(exc)
        del self.running[task.gen]
        if task.state is not None:
            self.runner.finish(task.state, Outcome("crashed", f"Ray: {reason}"))
            task.done.append(task.state.cell.repeat)
        rest = [r for r in task.work.repeats if r not in task.done]
        if rest and not task.unavailable:
            self.runner.progress(f"[{task.work.group.key}] repeats {rest} resubmitted after: {reason}")
            self.pending.appendleft(_Work(task.work.group, rest, task.node))

    def _cancel_all(self) -> None:
        """Ctrl-C: pending work is dropped, running cells are interrupted, every task is cancelled."""
        self.pending.clear()
        for task in self.running.values():
            if task.state is not None:
                self.runner.interrupted(task.state)
                task.state = None
            ray.cancel(task.gen)  # KeyboardInterrupt in the task: it kills its worker process
        deadline = time.monotonic() + _CANCEL_GRACE_S
        gens = list(self.running)
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


def _missing(needs: Mapping[str, float], node: Mapping[str, Any]) -> list[str]:
    have = node.get("Resources", {})
    return [k for k, v in needs.items() if float(have.get(k, 0)) < v]


def _alive_nodes() -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerHostname"] + n["NodeID"])


# --- on the node ------------------------------------------------------------------------------
@ray.remote(max_retries=0)
def _cell_task(spec: backends.BackendSpec, jobs: list[dict[str, Any]], npz: bytes, device: str,
               threads: Optional[int], timeout: Optional[float]) -> Iterator[tuple[str, Any]]:
    """Run the jobs (repeats) one after the other on this node; yield ``(kind, payload)``:
    ``start`` (repeat, node environment), ``message`` (a worker message), ``wait`` (seconds of
    silence), ``end`` (the worker's outcome)."""
    from ..results import environment
    from ..runner import python_for, worker_environ

    node_env = environment()
    with tempfile.TemporaryDirectory(prefix="benchbackend-ray-") as tmp:
        data = Path(tmp) / "data.npz"
        data.write_bytes(npz)
        python, env = python_for(spec), worker_environ(spec, device, threads)
        for job in jobs:
            yield "start", {"repeat": job["repeat"], "environment": node_env}
            outcome = yield from _stream_worker(python, env, dict(job, data=str(data)), timeout)
            yield "end", {"status": outcome.status, "message": outcome.message}
            if outcome.status == "unavailable":
                return  # the other repeats would say the same


class _Stop(Exception):
    """Raised inside ``run_worker``'s callback to make it kill its worker."""


def _stream_worker(python: str, env: Mapping[str, str], job: dict[str, Any],
                   timeout: Optional[float]) -> Iterator[tuple[str, Any]]:
    """``run_worker`` in a thread, its messages yielded as they come.

    The generator must yield while the worker runs, so ``run_worker`` cannot run on this thread;
    when the task is cancelled (KeyboardInterrupt here) the thread's next heartbeat, within a
    second, raises ``_Stop`` inside ``run_worker``, which kills the worker process group.
    """
    events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
    stop = threading.Event()
    heard = [time.monotonic()]  # when the driver last heard of this cell

    def on_message(msg: dict[str, Any]) -> None:
        heard[0] = time.monotonic()
        events.put(("message", msg))

    def on_wait(seconds: float) -> None:
        if stop.is_set():
            raise _Stop()
        if time.monotonic() - heard[0] >= HEARTBEAT_S:  # as locally: after each HEARTBEAT_S of silence
            heard[0] = time.monotonic()
            events.put(("wait", seconds))

    def target() -> None:
        try:
            outcome = run_worker(python, env, job, on_message=on_message, timeout=timeout, on_wait=on_wait,
                                 heartbeat_s=1.0)
        except _Stop:
            outcome = Outcome("interrupted", "cancelled")
        except BaseException as exc:  # the launcher's own failure: the cell's, not the task's
            outcome = Outcome("crashed", f"launcher failed on the node: {exc!r}")
        events.put(("outcome", outcome))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        while True:
            try:
                # A timeout, not a bare get(): Ray delivers a cancellation (KeyboardInterrupt) only
                # between bytecodes, never to a thread blocked in a lock.
                kind, payload = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "outcome":
                return payload
            yield kind, payload
    finally:
        stop.set()
        thread.join(timeout=10)
