"""Replicas across nodes: a ``--replicas N`` cell under the Ray executor runs on N Ray Train workers.

Each cell is one Ray Train run (``TorchTrainer``, ``placement_strategy="SPREAD"``: the replicas go
to different nodes where there are), one worker per replica, each reserving the same CPUs
(:func:`replica_cpus`: a whole node's, as a cell does, or a ``cells_per_node`` share; the replica's
threads are those CPUs). Worker ``r`` runs the cell's ordinary worker process on its node
(``launch.stream``, as ``ray_node.cell_task`` does) with the job's ``rank=r`` and
``rendezvous=tcp://<rank 0's node>:<a free port>``, which rank 0 picks and hands the others
through the cell's ``Mailbox`` actor. Every replica runs the whole worker protocol (SPMD); the
collectives happen only inside the adapter's training, which every replica reaches in the same
order because all run the same deterministic protocol on the same data and weights. Only rank 0's
messages go home: through the mailbox, which the cell's task (``replica_cells``, a streaming
generator on the driver's node) drains while ``trainer.fit()`` runs. The other ranks' messages are
dropped, but their failure fails the cell. Cancelled (Ctrl-C), the task tells the replicas through
the mailbox; each kills its worker and fails, and Ray Train then removes what it placed.

Faults: Ray Train retries nothing (every retry budget is 0: a retried cell would be measured
twice). A replica whose worker failed gives the cell that worker's status (``crashed``,
``timeout``, ``unavailable``) and message; a Ray Train worker lost with its node makes ``fit()``
raise, and the cell ends ``crashed`` with a one-line reason naming the replica and its node, also
when Ray Train reports the survivors' failed collectives first (a replica that never reported its
worker's end, on a node the cluster declares dead, is that reason). The rows already streamed are
kept, and the unit's next cells run if the live nodes still hold them.

Only an adapter that joins a process group made outside its worker (``options.rendezvous``) can be
started this way (its registry entry says so: ``Capabilities.ray_train``); another backend's
replica cells are ``unavailable``.

Over 400 lines: the cell's side (its task, ``_Run``, how the cell ended) and the replicas' side
(``_replica``) are the two ends of one protocol over the ``Mailbox``, read together.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Iterator, Mapping, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..launch import python_for, stream, worker_environ
from ..messages import Encoded, Ended, Outcome, Started, encode
from .ray_node import DataSource, alive_nodes, forward, materialize, normal_priority

if TYPE_CHECKING:
    from ..plan import GroupId
    from ..runner import Task

#: Where Ray Train keeps a run's files. Nothing is checkpointed: it holds only the marker that
#: Ray Train writes on each node to check the path, so one folder serves every cell and run.
_STORAGE = Path(tempfile.gettempdir()) / "benchbackend-ray-train"
_POLL_S = 0.2
#: How long a cancelled cell waits for its replicas to stop (less than the executor's cancel grace).
_STOP_GRACE_S = 8.0


def unsupported(task: "Task") -> str:
    """Why ``task``'s replicas cannot run through Ray Train ("" when they can)."""
    if task.spec.capabilities.ray_train:
        return ""
    return (f"{task.spec.name}: --replicas {task.job.options.replicas} under --executor ray runs the replicas "
            "as Ray Train workers, and this backend's data-parallel engine does not join a process group "
            "started by Ray Train (torch's does, through TorchTrainer); --executor local runs it on one machine")


def replica_cpus(nodes: Sequence[Mapping[str, Any]], n: int, needs: Mapping[str, float],
                 cells_per_node: Optional[int]) -> Optional[float]:
    """The CPUs each of ``n`` replicas reserves on the live ``nodes``, or None when they cannot hold
    ``n`` replicas that have ``needs`` (a GPU each, an isolated environment). As a cell does, a
    replica takes a whole node's CPUs, or ``1 / cells_per_node`` of them, where there are ``n`` such
    nodes; with fewer, the largest share of which the nodes hold ``n`` (replicas then share nodes)."""
    per = cells_per_node or 1
    totals = [float(node["Resources"].get("CPU", 0)) for node in nodes]
    shares = {_ray_cpus(total / (per * k)) for total in totals if total > 0 for k in range(1, n + 1)}
    for share in sorted(shares, reverse=True):
        if share > 0 and sum(_holds(node, share, needs) for node in nodes) >= n:
            return share
    return None


def too_few(nodes: Sequence[Mapping[str, Any]], n: int, needs: Mapping[str, float]) -> str:
    """Why ``replica_cpus`` found no share: what the ``n`` replicas need that the nodes lack."""
    extra = "".join(f", {k} {v:g}" for k, v in sorted(needs.items()))
    return (f"the live nodes of the Ray cluster ({len(nodes)}) cannot hold {n} replicas (one Ray Train worker "
            f"each, with CPUs{extra}): add nodes or use fewer --replicas")


def _ray_cpus(share: float) -> float:
    return float(int(share)) if share >= 1 else round(share, 4)  # Ray takes whole numbers above 1


def _holds(node: Mapping[str, Any], cpus: float, needs: Mapping[str, float]) -> int:
    """How many replicas of ``cpus`` CPUs and ``needs`` fit on ``node``."""
    have = node.get("Resources", {})
    return min(int(float(have.get(k, 0)) / v + 1e-9) for k, v in {"CPU": cpus, **needs}.items())


def start_replicas(tasks: Sequence["Task"], source: DataSource, cpus: float, needs: Mapping[str, float],
                   timeout: Optional[float]) -> Any:
    """Start the unit's cells (one Ray Train run each, in order) from a task on the driver's node,
    where Ray Train keeps its controller: a lost worker node costs the cell, not the stream that
    reports it. Returns the task's ``ray.ObjectRefGenerator``."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return replica_cells.options(scheduling_strategy=here).remote(list(tasks), source, cpus, dict(needs), timeout)


@ray.remote(num_cpus=0, max_retries=0)
def replica_cells(tasks: list["Task"], source: DataSource, cpus: float, needs: dict[str, float],
                  timeout: Optional[float]) -> Iterator[Encoded]:
    """Run the cells one after the other, each through Ray Train, yielding every message
    ``encode``d: ``Started``, rank 0's messages, ``Ended``. A cell the live nodes can no longer hold
    (a node was lost) is ``unavailable`` at once, rather than after Ray Train's minute of waiting for nodes."""
    given_up: set["GroupId"] = set()
    for task in tasks:
        cell = task.cell
        if cell.group in given_up:
            continue
        n = task.job.options.replicas
        alive = alive_nodes()
        if sum(_holds(node, cpus, needs) for node in alive) < n:
            yield encode(Started(cell, _environment()))
            yield encode(Ended(cell, Outcome("unavailable", too_few(alive, n, needs))))
            given_up.add(cell.group)
            continue
        outcome = yield from _cell(task, source, cpus, needs, timeout)
        yield encode(Ended(cell, outcome))
        if outcome.status == "unavailable":
            given_up.add(cell.group)


@ray.remote(num_cpus=0)
class Mailbox:
    """What a cell's replicas and its task exchange: rank 0's address for the others, the replicas'
    reports for the task, the task's stop for the replicas. Every call returns at once (callers poll),
    and a caller waits for each of its calls, so what one sends arrives in order and before it ends."""

    def __init__(self) -> None:
        self._address = ""
        self._reports: list[_Report] = []
        self._stopped = False

    def set_address(self, address: str) -> None:
        self._address = address

    def address(self) -> str:
        return self._address

    def post(self, report: "_Report") -> None:
        self._reports.append(report)

    def collect(self) -> list["_Report"]:
        reports, self._reports = self._reports, []
        return reports

    def stop(self) -> None:
        self._stopped = True

    def stopped(self) -> bool:
        return self._stopped


@dataclass(frozen=True)
class _Report:
    """What a replica tells the cell's task: its node, a message of rank 0's worker, its worker's end."""

    rank: int
    node: str = ""
    message: Optional[Encoded] = None
    outcome: Optional[Outcome] = None


class ReplicaFailed(RuntimeError):
    """A replica's worker ended otherwise than ``done`` (raised in its Ray Train worker so that Ray
    Train stops the others, which would wait for it in a collective)."""


def _cell(task: "Task", source: DataSource, cpus: float, needs: Mapping[str, float],
          timeout: Optional[float]) -> Generator[Encoded, None, Outcome]:
    """One cell: a Ray Train run, drained while it runs; the cell's outcome."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    box = Mailbox.options(scheduling_strategy=here).remote()
    job = task.job
    if "GPU" in needs:  # Ray Train shows each replica its own GPU, as cuda:0
        job = replace(job, device="cuda")
    config = {"task": replace(task, job=job), "source": source, "timeout": timeout, "threads": max(1, int(cpus)),
              "box": box}
    trainer = TorchTrainer(
        _replica, train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),  # Ray Train's own group carries nothing: the worker makes its own
        scaling_config=ScalingConfig(num_workers=job.options.replicas, use_gpu="GPU" in needs,
                                     resources_per_worker={"CPU": cpus, **needs}, placement_strategy="SPREAD"),
        run_config=RunConfig(name="cells", storage_path=str(_STORAGE),
                             failure_config=FailureConfig(max_failures=0, controller_failure_limit=0,
                                                          max_preemption_failures=0)))
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - the cell's outcome says why
            failed.append(exc)

    run = _Run(task)
    fitting = threading.Thread(target=fit, daemon=True, name="benchbackend-ray-train-fit")
    fitting.start()
    try:
        while True:
            ending = not fitting.is_alive()  # read before the last collect: every report came before fit ended
            got = ray.get(box.collect.remote())
            for report in got:
                message = run.take(report)
                if message is not None:
                    yield message
            if ending and not got:
                break
            if not got:
                time.sleep(_POLL_S)
    except BaseException:
        # Cancelled (Ctrl-C on the driver): the replicas stop within a second (``_replica``), and
        # Ray Train removes its workers and their placement. Should that not happen in time, this
        # process exits: Ray Train's controller is its actor and dies with it.
        ray.get(box.stop.remote())
        fitting.join(_STOP_GRACE_S)
        if fitting.is_alive():
            os._exit(1)
        raise
    finally:
        ray.kill(box)
    if not run.started:  # the run failed before rank 0's worker started
        yield encode(Started(task.cell, _environment()))
    failure = failed[0] if failed else None
    unnamed = failure is not None and _lost(failure) is None  # Ray Train named no lost worker
    return run.outcome(failure, _dead_silent_replica(run, _node_death_s()) if unnamed else None)


def _node_death_s() -> float:
    """How long the cluster's head takes to declare dead a node whose raylet stopped answering: its
    first health check's delay, then so many failed checks (Ray's defaults: 5 + 5 x 3 + 10 = 30 s)."""
    from ray._raylet import Config

    return (Config.health_check_initial_delay_ms() + Config.health_check_failure_threshold()
            * Config.health_check_period_ms() + Config.health_check_timeout_ms()) / 1e3


def _dead_silent_replica(run: "_Run", wait_s: float) -> Optional[int]:
    """The rank of a replica that never reported its end (each failed replica reports it before it
    raises) on a node the cluster declared dead within ``wait_s``; else None. Ray Train may report
    the survivors' failed collectives before it sees the node gone: the node is why the cell failed.
    A replica silent because Ray Train stopped it after another failed costs the cell that wait."""
    silent = {rank: run.nodes[rank] for rank in range(run.replicas) if rank not in run.ends and rank in run.nodes}
    deadline = time.monotonic() + wait_s
    while silent:
        alive = {node["NodeID"] for node in alive_nodes()}
        dead = [rank for rank, node in sorted(silent.items()) if node not in alive]
        if dead:
            return dead[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    return None


class _Run:
    """The reports of one cell's replicas, as they arrive: where each runs, rank 0's messages, the ends."""

    def __init__(self, task: "Task"):
        self.replicas = task.job.options.replicas
        self.nodes: dict[int, str] = {}
        self.ends: dict[int, Outcome] = {}
        self.started = False

    def take(self, report: _Report) -> Optional[Encoded]:
        """The message to yield for ``report`` (None: it only informs)."""
        if report.node:
            self.nodes[report.rank] = report.node
        if report.outcome is not None:
            self.ends[report.rank] = report.outcome
        if report.message is None:
            return None
        order, kind, fields = report.message
        self.started = self.started or kind == "Started"
        if kind == "Row" and fields["fields"].get("phase") == "build" and len(self.nodes) == self.replicas:
            # Where Ray Train placed the replicas, only the cell's task knows: the build row says it.
            row = dict(fields["fields"])
            placed = "Ray Train nodes " + ", ".join(self.nodes[r][:8] for r in range(self.replicas))
            row["notes"] = "; ".join(filter(None, [row.get("notes"), placed + " (by rank)"]))
            return order, kind, {**fields, "fields": row}
        return report.message

    def outcome(self, failure: Optional[BaseException], dead: Optional[int] = None) -> Outcome:
        """The cell's outcome: a replica that was ``unavailable``; else a Ray Train worker lost (its
        node, say), as Ray Train reports it or as the cluster does (``dead``: the rank of a silent
        replica whose node died, :func:`_dead_silent_replica`); else the first replica whose worker
        failed, in rank order; else Ray Train's own failure; else ``done``."""
        ended = sorted(self.ends.items())
        for rank, end in ended:
            if end.status == "unavailable":
                return _as_replica(rank, end)
        lost = _lost(failure) or (None if dead is None else (dead, "its node died"))
        if lost:
            rank, why = lost
            where = f" on node {self.nodes[rank][:8]}" if rank in self.nodes else ""
            return Outcome("crashed", f"Ray Train lost replica {rank}{where}: {why}"[:400])
        for rank, end in ended:
            if end.status != "done":
                return _as_replica(rank, end)
        if failure is not None:
            return Outcome("crashed", f"Ray Train: {_first_line(failure)}"[:400])
        if len(ended) < self.replicas:
            return Outcome("crashed", f"Ray Train ended with {len(ended)} of {self.replicas} replicas reporting")
        return Outcome("done", "", 0)


def _as_replica(rank: int, end: Outcome) -> Outcome:
    return end if rank == 0 else replace(end, message=f"replica {rank}: {end.message}")


def _lost(failure: Optional[BaseException]) -> Optional[tuple[int, str]]:
    """(rank, why) of the first Ray Train worker that failed for a reason of Ray's (a failed health
    check, a dead actor or node), not because its worker process failed (``ReplicaFailed``)."""
    from ray.train import WorkerGroupError

    if not isinstance(failure, WorkerGroupError):
        return None
    for rank, exc in sorted(failure.worker_failures.items()):
        if not isinstance(exc, ReplicaFailed):
            return int(rank), _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _environment() -> dict[str, str]:
    from ...results import environment

    return environment()


def _replica(config: dict[str, Any]) -> None:
    """One Ray Train worker: replica ``rank`` of the cell, its worker process on this node."""
    from ray import train

    rank = train.get_context().get_world_rank()
    task, box = config["task"], config["box"]
    if rank == 0:
        rendezvous = _free_address()
        ray.get(box.set_address.remote(rendezvous))
    else:
        while not (rendezvous := ray.get(box.address.remote())):
            time.sleep(0.1)
    ray.get(box.post.remote(_Report(rank, node=ray.get_runtime_context().get_node_id())))
    node_env = {**_environment(), **normal_priority()}
    with tempfile.TemporaryDirectory(prefix="benchbackend-replica-") as tmp:
        try:
            path, origin = materialize(config["source"], Path(tmp))
        except Exception as exc:  # noqa: BLE001 - the cell says why; no replica runs on other data
            outcome = Outcome("crashed", f"data on {node_env['host']}: {exc}")
        else:
            job = task.job.with_data(str(path))
            options = replace(job.options, rank=rank, rendezvous=rendezvous, threads=config["threads"])
            job = replace(job, options=options)
            if rank == 0:
                ray.get(box.post.remote(_Report(0, message=encode(Started(task.cell, {**node_env,
                                                                                      "data_origin": origin})))))

            def awake() -> None:  # each second of the worker's silence
                if ray.get(box.stopped.remote()):
                    raise ReplicaFailed(f"replica {rank}: stopped (the run was interrupted)")

            # No preloader: a replica's worker must be this process's child, to exit with it (torch_ddp).
            env = worker_environ(task.spec, job.device, job.options.threads)
            messages = forward(stream(task.cell, python_for(task.spec), env, job, config["timeout"], heartbeat_s=1.0),
                               awake)
            outcome = _drain(messages, box if rank == 0 else None)
    ray.get(box.post.remote(_Report(rank, outcome=outcome)))
    if outcome.status != "done":
        raise ReplicaFailed(f"replica {rank}: {outcome.status}: {outcome.message}")


def _drain(messages: Generator[Encoded, None, Outcome], box: Any) -> Outcome:
    """Run a worker to its end, each message to ``box`` (None: dropped); its outcome."""
    while True:
        try:
            message = next(messages)
        except StopIteration as stop:
            return stop.value
        if box is not None:
            ray.get(box.post.remote(_Report(0, message=message)))


def _free_address() -> str:
    """``tcp://<this node's address>:<a port free now>`` for the worker processes' process group."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"
