"""Replicas across Ray nodes (issue 22): under the Ray executor a ``--replicas 2`` torch cell runs one
replica per node through Ray Train, streams rank 0's rows home and passes replica parity; a node
lost mid-cell makes that cell ``crashed`` and keeps every row already written. On a local
two-node cluster (``ray.cluster_utils.Cluster``, ``support.scale``), the replicas talking gloo.

The stalling adapter is a class of this module: the replicas' worker processes import it by name."""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import scale

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.run import plan as planning
from benchbackend.run import progress, runner
from benchbackend.spec import workload
from conftest import requires_torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, requires_torch,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train")
                                 is None, reason="Ray Train is not installed (pip install 'benchbackend[ray]')")]

try:
    from benchbackend.backends.torch.replicas import TorchDDPBackend
except ImportError:  # torch absent: the module skips
    TorchDDPBackend = object


class StallingReplica(TorchDDPBackend):
    """Replica 1 stalls at the start of epoch 2 (after it wrote its Ray worker's PID to ``STALL_MARK``,
    and its own niceness beside it) until the test removes its node; replica 0 has streamed epoch 1's
    row by then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epochs = 0

    def train_epoch(self, order):
        self.epochs += 1
        if self.epochs == 2 and self.rank == 1:
            from support.killer_backend import ray_worker

            mark = Path(os.environ["STALL_MARK"])
            mark.with_suffix(".nice").write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))  # this worker's
            mark.with_suffix(".tmp").write_text(str(ray_worker()))
            mark.with_suffix(".tmp").rename(mark)
            time.sleep(120)
        return super().train_epoch(order)


@pytest.fixture(scope="module")
def cluster():
    """A head that takes no cells, joined by the driver; each test adds its two worker nodes.

    Ray Train's controller polls its workers every 0.2 s, not every 2 s: it then reports the
    surviving replica's failed collective before the lost node's worker (each time, in runs here),
    the order in which the node-lost test must still read a lost node, not a gloo error."""
    with scale.simulated_cluster(0, env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}) as c:
        yield c


@pytest.fixture
def two_nodes(cluster):
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)


def _run(tmp_path: Path, plan: planning.RunPlan) -> list:
    from benchbackend.run.executors.ray import RayExecutor

    return runner.Runner(plan, RayExecutor(), results.CsvWriter(tmp_path / "out.csv")).run()


def _plan(choices: list[planning.Choice], epochs: int) -> planning.RunPlan:
    # 512 samples, 2 epochs: enough SGD steps for a correct run to clear the chance check.
    w = workload.load("mnist").with_overrides(limit=512, epochs=epochs)
    return planning.RunPlan(workloads=[w], choices=choices, data_source="synthetic", parity_steps=3)


def test_replicas_reserve_whole_nodes_where_there_are_enough_and_share_them_where_not():
    from benchbackend.run.executors.ray_train import replica_cpus

    def node(cpus, **extra):
        return {"Resources": {"CPU": cpus, **extra}}

    assert replica_cpus([node(8), node(8)], 2, {}, None) == 8  # a whole node each
    assert replica_cpus([node(8), node(8)], 2, {}, 2) == 4  # --cells-per-node 2: half a node each
    assert replica_cpus([node(8)], 2, {}, None) == 4  # one node: they share it
    assert replica_cpus([node(8), node(4)], 2, {}, None) == 4  # the most each can have
    assert replica_cpus([node(8), node(4), node(0)], 3, {}, None) == 4
    assert replica_cpus([node(8, GPU=1), node(8)], 2, {"GPU": 1}, None) is None  # a GPU each: one node has one
    assert replica_cpus([node(8, GPU=2)], 2, {"GPU": 1}, None) == 4
    assert replica_cpus([node(1), node(0)], 2, {}, None) == 0.5
    assert replica_cpus([node(0)], 2, {}, None) is None  # a head that takes no work


def test_a_silent_replica_on_a_dead_node_is_the_reason_not_the_survivors_collective_error():
    from benchbackend.run.executors.ray_train import ReplicaFailed, _dead_silent_replica, _Run
    from benchbackend.run.messages import Outcome

    run = _Run(SimpleNamespace(job=SimpleNamespace(options=SimpleNamespace(replicas=2))))  # it reads no more
    run.nodes.update({0: "aaaaaaaa0000", 1: "bbbbbbbb1111"})
    run.ends[0] = Outcome("crashed", "Connection closed by peer")  # replica 0's gloo, its peer gone
    failure = ReplicaFailed("replica 0: crashed: Connection closed by peer")
    assert run.outcome(failure).message == "Connection closed by peer"  # the cluster not asked: the survivor
    lost = run.outcome(failure, dead=1)
    assert lost.status == "crashed" and lost.message == "Ray Train lost replica 1 on node bbbbbbbb: its node died"
    run.ends[1] = Outcome("crashed", "loss is nan")  # every replica reported its end: none is silent,
    assert _dead_silent_replica(run, wait_s=60) is None  # so no node is looked up and nothing waits


def test_two_replicas_run_on_two_nodes_and_pass_replica_parity(two_nodes, tmp_path, monkeypatch):
    numpy = backends.get("numpy")  # an engine of one machine: Ray Train cannot start its replicas
    monkeypatch.setitem(backends.BACKENDS, "numpy-dp", replace(numpy, name="numpy-dp", capabilities=replace(
        numpy.capabilities, replicas=numpy.target)))
    cells = _run(tmp_path, _plan([planning.Choice("torch", "eager", "fp32", replicas=2),
                                  planning.Choice("numpy-dp", "reference", "fp32", replicas=2)], epochs=2))
    assert {c.backend: c.status for c in cells} == {"torch": "ok", "numpy-dp": "unavailable"}
    refused = next(c for c in cells if c.backend == "numpy-dp").message
    assert "does not join a process group started by Ray Train" in refused and "--executor local" in refused
    df = results.read(tmp_path / "out.csv")
    df = df[df.backend == "torch"]
    assert set(df["replicas"]) == {2} and set(df["status"]) == {"ok"}
    assert df[df.phase == "train_epoch"]["epoch"].tolist() == [1, 2]  # rank 0's rows only, once each
    assert (df.phase == "inference").sum() == workload.load("mnist").inference.repeats
    trajectory = df[(df.phase == "parity") & (df["steps"] == 3)]
    assert len(trajectory) == 1 and trajectory["parity_step"].isna().all()  # the 3 steps match the reference
    notes = df[df.phase == "build"]["notes"].iloc[0]
    assert "replicas 2 (DistributedDataParallel, gloo, Ray Train)" in notes
    placed = notes.split("Ray Train nodes ")[1].split(" (by rank)")[0].split(", ")
    assert sorted(placed) == sorted(n.node_id[:8] for n in two_nodes.worker_nodes)  # one replica per node


def test_a_node_lost_mid_cell_crashes_that_cell_and_keeps_every_row_written(two_nodes, tmp_path, monkeypatch):

    mark = tmp_path / "stalled"
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    torch = backends.get("torch")
    target = "test_ray_train:StallingReplica"
    spec = replace(torch, name="stalling", capabilities=replace(torch.capabilities, replicas=target),
                   env=lambda device: {"STALL_MARK": str(mark), "PYTHONPATH": path})
    monkeypatch.setitem(backends.BACKENDS, "stalling", spec)
    removed, niceness = [], []

    def remove_the_stalled_node() -> None:
        deadline = time.monotonic() + 240
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        niceness.append(int(mark.with_suffix(".nice").read_text()))  # replica 1's worker process
        node = scale.node_of(int(mark.read_text()), two_nodes)
        two_nodes.remove_node(node, allow_graceful=False)
        removed.append(node)

    remover = threading.Thread(target=remove_the_stalled_node, daemon=True)
    remover.start()
    # A cell of one replica first (it runs alone on a node), then the two replicas on both nodes.
    plan = _plan([planning.Choice("numpy", "reference", "fp32"),
                  planning.Choice("stalling", "eager", "fp32", replicas=2)], epochs=2)
    cells = _run(tmp_path, plan)
    remover.join(timeout=1)
    assert removed, "the stalled replica's node was never removed"
    assert niceness == [0] or os.geteuid() != 0  # not Ray's 15, where this user may lower a niceness
    assert [(c.backend, c.status) for c in cells] == [("numpy", "ok"), ("stalling", "crashed")]
    lost = cells[1].message
    assert lost.startswith(f"Ray Train lost replica 1 on node {removed[0].node_id[:8]}: ") and "\n" not in lost, lost
    df = results.read(tmp_path / "out.csv")
    crashed = df[df.backend == "stalling"]
    assert set(crashed["status"]) == {"crashed"}
    assert crashed[crashed.phase == "train_epoch"]["epoch"].tolist() == [1]  # streamed before the loss: kept
    assert {"build", "parity", "run"} <= set(crashed["phase"])
    kept = df[df.backend == "numpy"]
    assert set(kept["status"]) == {"ok"} and kept[kept.phase == "train_epoch"]["epoch"].tolist() == [1, 2]


def test_ctrl_c_stops_the_replicas_and_gives_their_nodes_back(two_nodes, tmp_path):
    import ray

    from benchbackend.run.executors.ray import RayExecutor

    class Interrupting(progress.Display):
        def note(self, text: str) -> None:
            if "epoch 1/" in text:
                raise KeyboardInterrupt  # as Ctrl-C would, while the driver handles a streamed row

    plan = _plan([planning.Choice("torch", "eager", "fp32", replicas=2)], epochs=3)
    r = runner.Runner(plan, RayExecutor(), results.CsvWriter(tmp_path / "int.csv"), Interrupting())
    with pytest.raises(KeyboardInterrupt):
        r.run()
    assert [c.status for c in r.results] == ["interrupted"]
    df = results.read(tmp_path / "int.csv")
    assert set(df["status"]) == {"interrupted"} and df[df.phase == "train_epoch"]["epoch"].tolist() == [1]
    # The replicas have stopped and Ray Train has removed their placement: both nodes are free again.
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the interrupted replicas still hold their nodes"
        time.sleep(0.2)
    assert {pg["state"] for pg in ray.util.placement_group_table().values()} <= {"REMOVED"}
