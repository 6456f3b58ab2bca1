"""What runs on a Ray node: the task that runs a unit's cells there, where it finds their data, and
the resources a node must have for a cell (which the driver's placement and ``ray_train`` match).

The arrays a cell reads (``data.prepare``: the splits and the epoch orders) are found on the node,
in this order, and checked against the checksum the driver computed (``arrays.checksum``):

1. ``node-cache``: the node's cache (``$BENCHBACKEND_CACHE/data/<sha256>.npz``), put there by an
   earlier task;
2. ``generated``: synthetic data is made on the node from the workload and its seed;
3. ``shared-path``: the driver's own file, where the node sees it (a shared file system);
4. ``fetched``: pulled from the driver's object store, once per node (it is then cached).

Only the last moves the data over the network, and then once per node, not once per cell. The
CSV records the checksum (``data_sha256``) and the route (``data_origin``) of every cell.

A cell's worker runs at the normal priority, as under the local executor, not at the niceness
Ray gives its worker processes (15 by default, ``worker_niceness``): :func:`normal_priority`.
"""
from __future__ import annotations

import os
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import numpy as np
import ray

from ...backends import registry as backends
from ...backends.spec import gpu_index
from ..launch import HEARTBEAT_S, python_for, stream, worker_environ
from ..messages import Ended, Heartbeat, Outcome, Started, encode

if TYPE_CHECKING:
    from ...spec.workload import Workload
    from ..plan import GroupId
    from ..runner import Task

ENV_RESOURCE = "benchbackend-env-{}"
#: How much of a node's ``benchbackend-env-*`` resource a cell takes: a marker, not a limit.
ENV_SHARE = 0.001


def local_resources() -> dict[str, float]:
    """The custom resources this machine advertises: one per isolated environment ready here."""
    from ...backends import envs

    return {ENV_RESOURCE.format(name): 1.0 for name in backends.isolated_envs() if envs.is_ready(name)}


def needs(task: "Task") -> dict[str, float]:
    """The Ray resources a cell needs besides CPUs: a GPU, an isolated environment."""
    out = {"GPU": 1.0} if task.job.device != "tpu" and gpu_index(task.job.device, task.spec.name) is not None else {}
    if task.spec.isolated_env:
        out[ENV_RESOURCE.format(task.spec.isolated_env)] = ENV_SHARE
    return out


def missing(wanted: Mapping[str, float], node: Mapping[str, Any]) -> list[str]:
    """What ``node`` lacks of ``wanted``; a node without CPUs (a head started with ``--num-cpus 0``,
    to keep work off it) takes no cell."""
    have = node.get("Resources", {})
    lacks = [k for k, v in wanted.items() if float(have.get(k, 0)) < v]
    return lacks if float(have.get("CPU", 0)) > 0 else ["CPU", *lacks]


def alive_nodes() -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerHostname"] + n["NodeID"])


@dataclass(frozen=True)
class DataSource:
    """What a node needs to find a unit's arrays: their checksum, the workload that made them (only
    for synthetic data, which the node can make), the driver's path, and the driver's copy in the
    object store (wrapped in a list so that Ray does not fetch it with the task's arguments)."""

    sha256: str
    path: str
    synthetic: Optional["Workload"]
    stored: list[Any]


def node_cache(sha256: str) -> Path:
    from ... import paths

    return paths.cache_dir() / "data" / f"{sha256}.npz"


def materialize(source: DataSource, scratch: Path) -> tuple[Path, str]:
    """The path of the unit's arrays on this node and how they got there (see the module docstring).
    Raises ``ValueError`` when no route gives arrays with the driver's checksum."""
    from ...data import arrays
    from ...data import datasets as data

    cached = node_cache(source.sha256)
    if cached.is_file() and _matches(cached, source.sha256):
        return cached, "node-cache"
    if source.synthetic is not None:
        made = arrays.of(source.synthetic, data.synthetic(source.synthetic))
        if arrays.checksum(made) == source.sha256:
            return _keep(source.sha256, scratch, lambda p: np.savez(p, **made)), "generated"
    if source.path and Path(source.path).is_file() and _matches(Path(source.path), source.sha256):
        return Path(source.path), "shared-path"
    blob: bytes = ray.get(source.stored[0])
    path = _keep(source.sha256, scratch, lambda p: p.write_bytes(blob))
    if not _matches(path, source.sha256):
        path.unlink(missing_ok=True)
        raise ValueError(f"the arrays fetched from the driver do not match their checksum {source.sha256[:12]}")
    return path, "fetched"


def _matches(path: Path, sha256: str) -> bool:
    from ...data import arrays

    try:
        return arrays.checksum(path) == sha256
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False  # unreadable, truncated or not an .npz: not the arrays


def _keep(sha256: str, scratch: Path, write: Any) -> Path:
    """Write the arrays into the node's cache (atomically: tasks on one node may race), or into the
    task's ``scratch`` folder when the cache cannot be written."""
    target = node_cache(sha256)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".npz")
        os.close(fd)
    except OSError:
        target = scratch / f"{sha256}.npz"
        write(target)
        return target
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@ray.remote(max_retries=0)
def cell_task(tasks: list["Task"], source: DataSource, share: Optional[int], timeout: Optional[float],
              preload: bool = True) -> Iterator[Any]:
    """Run the cells one after the other on this node, yielding every message ``encode``d. ``share``:
    the threads of this node's share of CPUs, unless the user set ``--threads``. With ``preload``,
    CPU cells' workers are forked from a process that imported the backend once (``preload.py``),
    as on the local executor."""
    from ...results import environment
    from ..preload import Preloaders

    node_env = {**environment(), **normal_priority()}  # before the preloaders: they and their workers inherit it
    given_up: set["GroupId"] = set()
    with tempfile.TemporaryDirectory(prefix="benchbackend-ray-") as tmp, Preloaders() as preloaders:
        try:
            path, origin = materialize(source, Path(tmp))
        except Exception as exc:  # noqa: BLE001 - every cell says why, none runs on other data
            for task in tasks:
                yield encode(Started(task.cell, node_env))
                yield encode(Ended(task.cell, Outcome("crashed", f"data on {node_env['host']}: {exc}")))
            return
        for task in tasks:
            cell = task.cell
            if cell.group in given_up:
                continue  # its other repeats would say the same
            job = task.job.with_data(str(path))
            job = job.with_threads(job.options.threads or share)
            python, env = python_for(task.spec), worker_environ(task.spec, job.device, job.options.threads)
            yield encode(Started(cell, {**node_env, "data_origin": origin}))
            forked = preloaders if preload and job.device == "cpu" else None
            outcome = yield from forward(stream(cell, python, env, job, timeout, heartbeat_s=1.0, preloaders=forked))
            yield encode(Ended(cell, outcome))
            if outcome.status == "unavailable":
                given_up.add(cell.group)


def normal_priority() -> dict[str, str]:
    """Give this Ray worker (on Linux the calling thread), and so the cell's worker that it starts,
    the normal priority (niceness 0). Ray starts its workers at niceness 15, so that its raylet
    comes first; beside a process of normal priority the kernel gives one at 15 a share of 36 to
    its 1024, and a cell's timings would measure that. Lowering a niceness takes CAP_SYS_NICE:
    without it, the niceness kept, for the cell's environment (``{"nice": "15"}``; else ``{}``)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return {}
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return {"nice": str(nice)}
    return {}


def forward(messages: Any, awake: Optional[Callable[[], None]] = None) -> Any:
    """Yield a worker's messages ``encode``d, a heartbeat only after each ``HEARTBEAT_S`` of silence.

    The stream wakes every second so that a cancellation (KeyboardInterrupt, which Ray delivers
    only between bytecodes) lands within a second; the stream's own cleanup then kills the worker.
    ``awake`` is called at each such wake (a replica asks whether its run was stopped: ``ray_train``)."""
    heard = time.monotonic()
    try:
        while True:
            try:
                message = next(messages)
            except StopIteration as stop:
                return stop.value
            if isinstance(message, Heartbeat) and awake is not None:
                awake()
            if isinstance(message, Heartbeat) and time.monotonic() - heard < HEARTBEAT_S:
                continue
            heard = time.monotonic()
            yield encode(message)
    finally:
        messages.close()
