"""The Ray executor on a local multi-node cluster (``ray.cluster_utils.Cluster``): a node lost
mid-run costs only its cell (crashed, or retried under ``retries``); work waits for a node to join."""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
from support import scale

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.backends.registry import BackendSpec, Mode
from benchbackend.run import plan as planning
from benchbackend.run import runner
from benchbackend.spec import workload

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                    reason="Ray is not installed (pip install 'benchbackend[ray]')")]


@pytest.fixture(scope="module")
def cluster():
    """A head that takes no cells (no CPUs, as on a real cluster), joined by the driver; each test
    adds the worker nodes it needs, and they are removed after it."""
    with scale.simulated_cluster(0) as c:
        yield c


@pytest.fixture
def nodes(cluster):
    yield cluster
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)


def _executor(**kwargs):
    from benchbackend.run.executors.ray import RayExecutor

    return RayExecutor(**kwargs)


def _plan(backend: str, *overrides: dict) -> planning.RunPlan:
    loaded = [workload.load("mnist").with_overrides(**o) for o in overrides]
    return planning.RunPlan(workloads=loaded, choices=planning.resolve([backend], [], []), repeats=2,
                            data_source="synthetic")


def _run(tmp_path: Path, plan: planning.RunPlan, executor) -> list:
    return runner.Runner(plan, executor, results.CsvWriter(tmp_path / "out.csv")).run()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_node_removed_mid_cell_costs_that_cell_only(nodes, tmp_path, monkeypatch, retries):
    mark = tmp_path / "stalled"
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    # The first worker to reach epoch 2 stalls (KILLER_GRACE) until the test removes its node.
    spec = BackendSpec("killer", "support.killer_backend:KillerNumpyBackend", ("numpy",), "numpy", "(test only)",
                       "the NumPy reference; its first worker stalls in epoch 2", modes=(Mode("reference", "NumPy"),),
                       env=lambda device: {"KILLER_MARK": str(mark), "KILLER_GRACE": "300", "PYTHONPATH": path})
    monkeypatch.setitem(backends.BACKENDS, "killer", spec)
    for _ in range(2):
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    removed, niceness = [], []

    def remove_the_stalled_node() -> None:
        deadline = time.monotonic() + 240
        while not (mark.exists() and mark.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        niceness.append(int(mark.with_suffix(".nice").read_text()))  # the stalled cell's worker process
        node = scale.node_of(int(mark.read_text()), nodes)
        nodes.remove_node(node, allow_graceful=False)
        removed.append(node)

    remover = threading.Thread(target=remove_the_stalled_node, daemon=True)
    remover.start()
    # Two comparison groups (two definitions): each runs on its own node, side by side.
    plan = _plan("killer", {"limit": 512, "epochs": 2}, {"limit": 512, "epochs": 3})
    cells = _run(tmp_path, plan, _executor(retries=retries))
    remover.join(timeout=1)
    assert removed, "the stalled cell's node was never removed"
    assert niceness == [0] or os.geteuid() != 0  # not Ray's 15, where this user may lower a niceness
    statuses = sorted(c.status for c in cells)
    assert len(cells) == 4  # every cell ended once, whatever its node
    df = results.read(tmp_path / "out.csv")
    lost = df[df["status"].isin(["crashed", "retried"])]
    assert lost[["cell_order", "attempt"]].drop_duplicates().shape[0] == 1  # one attempt was lost
    order = int(lost["cell_order"].iloc[0])
    assert lost[lost.phase == "train_epoch"]["epoch"].tolist() == [1]  # streamed before the loss: kept
    run_row = lost[lost.phase == "run"].iloc[0]
    assert "Ray" in run_row["message"]
    if retries:
        assert statuses == ["ok"] * 4 and set(lost["status"]) == {"retried"}
        assert "retry 1 of 1" in run_row["message"]
        again = df[(df.cell_order == order) & (df.attempt == 2)]
        assert set(again["status"]) == {"ok"}
        assert again[again.phase == "train_epoch"]["epoch"].tolist() in ([1, 2], [1, 2, 3])
    else:
        assert statuses == ["crashed", "ok", "ok", "ok"] and set(lost["status"]) == {"crashed"}
        assert set(df[df.cell_order == order]["attempt"]) == {1}
    # Every other cell's rows are all there, once: a full set of epochs each.
    for (o, attempt), rows in df[df["status"] == "ok"].groupby(["cell_order", "attempt"]):
        epochs = rows[rows.phase == "train_epoch"]["epoch"].tolist()
        assert sorted(epochs) == list(range(1, len(epochs) + 1)) and len(epochs) in (2, 3), (o, attempt)
    # The compared rows leave the lost attempt out.
    from benchbackend.analysis import experiments

    assert not experiments.for_comparison(df)["status"].isin(["retried"]).any()


def test_a_niceness_that_cannot_be_lowered_is_kept_and_said_once_per_host(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from support import inprocess

    from benchbackend.cli import main
    from benchbackend.run.executors import ray_node
    from benchbackend.run.messages import Started

    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as m:  # a user without CAP_SYS_NICE, in a Ray worker at niceness 15
        m.setattr(os, "getpriority", lambda *args: 15)
        m.setattr(os, "setpriority", refused)
        kept = ray_node.normal_priority()
    assert kept == {"nice": "15"}
    inprocess.use(monkeypatch)
    real = inprocess.InProcessExecutor.run

    def on_that_node(self, tasks):  # each cell's environment as cell_task gives it
        for message in real(self, tasks):
            yield Started(message.cell, {"host": "node-a", **kept}) if isinstance(message, Started) else message

    monkeypatch.setattr(inprocess.InProcessExecutor, "run", on_that_node)
    out = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--inference-only", "--data", "synthetic", "--limit",
                                    "200", "--repeats", "2", "--no-plots", "-o", str(tmp_path / "r.csv")])
    assert out.exit_code == 0, out.output
    assert out.output.count("warning: cells on node-a run at niceness 15 (Ray's worker_niceness)") == 1, out.output
    assert "RAY_worker_niceness=0" in out.output


def test_work_waits_for_a_node_to_join_then_runs(nodes, tmp_path):
    ended: list = []
    run = threading.Thread(target=lambda: ended.extend(
        _run(tmp_path, _plan("numpy", {"limit": 512, "epochs": 2}), _executor(wait_for_nodes=120))), daemon=True)
    run.start()
    time.sleep(3)
    assert run.is_alive() and not ended  # no node can take the cells yet: they wait
    nodes.add_node(num_cpus=1)  # (Ray starts nodes from the main thread only)
    run.join(timeout=150)
    assert [c.status for c in ended] == ["ok", "ok"]


def test_without_a_node_to_take_it_work_is_unavailable_after_the_wait(nodes, tmp_path):
    start = time.monotonic()
    cells = _run(tmp_path, _plan("numpy", {"limit": 256, "epochs": 1}), _executor(wait_for_nodes=2))
    assert time.monotonic() - start >= 2
    assert [c.status for c in cells] == ["unavailable"]
    assert "has CPU (after waiting 2s for nodes to join)" in cells[0].message
