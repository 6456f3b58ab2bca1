"""The load test, small (issue 25): many tiny cells through the local executor and through Ray on a
simulated four-node cluster; every row arrives once, with the right status. Time is the
benchmark's business (``benchmarks/cells_at_scale.py``), not this test's."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support import scale

from benchbackend import results
from benchbackend.run import runner
from benchbackend.run.executors.local import LocalExecutor

pytestmark = pytest.mark.slow

CELLS = 48
#: Rows of one tiny cell: build, forward parity, one epoch, two inference passes, its run row.
PHASES = ["build", "parity", "train_epoch", "inference", "inference", "run"]


def _check(path: Path, cells: list, expected: int) -> None:
    assert sorted(c.cell.order for c in cells) == list(range(expected))
    assert {c.status for c in cells} == {"ok"}
    df = results.read(path)
    assert set(df["status"]) == {"ok"} and set(df["attempt"]) == {1}
    for order, rows in df.groupby("cell_order"):
        assert sorted(rows["phase"]) == sorted(PHASES), order
    assert df["cell_order"].nunique() == expected and len(df) == expected * len(PHASES)
    assert df["data_sha256"].nunique() == df["seed"].nunique() == 4  # one data set per definition


def test_many_cells_on_the_local_executor(tmp_path):
    out = tmp_path / "local.csv"
    cells = runner.Runner(scale.plan(tmp_path, CELLS), LocalExecutor(), results.CsvWriter(out)).run()
    _check(out, cells, CELLS)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is not installed (pip install 'benchbackend[ray]')")
def test_many_cells_on_a_simulated_four_node_cluster(tmp_path):
    from benchbackend.run.executors.ray import RayExecutor

    out = tmp_path / "ray.csv"
    with scale.simulated_cluster(4) as cluster:
        assert len(cluster.worker_nodes) == 4
        cells = runner.Runner(scale.plan(tmp_path, CELLS), RayExecutor(), results.CsvWriter(out)).run()
    _check(out, cells, CELLS)
    assert set(results.read(out)["data_origin"]) <= {"generated", "node-cache"}  # made on the nodes, not shipped
