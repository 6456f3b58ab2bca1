"""Many tiny cells, for the load test (``tests/test_scale.py``) and its benchmark
(``benchmarks/cells_at_scale.py``): what the driver costs per cell, not what a backend does.

A cell is the NumPy reference on a tiny network (a 4x4 input, one dense layer, 256 generated
samples, one epoch, two inference passes), in a real worker process: its work is a few
milliseconds, so the time around it (starting the worker, placing it, streaming its rows home,
writing them) is what a run of thousands of them measures. ``definitions`` workloads (seeds) make
as many comparison groups, which the Ray executor spreads over its nodes.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from benchbackend.run import plan as planning
from benchbackend.spec import workload

TINY = {
    "name": "tiny",
    "description": "load test: a 4x4 input, one dense layer",
    "seed": 0,
    "data": {"dataset": "synthetic", "input_shape": [4, 4, 1], "num_classes": 2, "train": 256, "validation": 64,
             "test": 64},
    "model": [{"type": "flatten"}, {"type": "dense", "units": 2, "activation": "softmax"}],
    "training": {"optimizer": "sgd", "lr": 0.5, "loss": "categorical_crossentropy", "batch_size": 32, "epochs": 1},
    "inference": {"batch_size": 64, "repeats": 2},
}


def plan(folder: Path, cells: int, definitions: int = 4) -> planning.RunPlan:
    """A plan of ``cells`` cells (``cells / definitions`` repeats of each of ``definitions`` seeds)."""
    if cells % definitions:
        raise ValueError(f"{cells} cells do not split into {definitions} definitions")
    path = Path(folder) / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    loaded = [workload.load(str(path)).with_overrides(seed=seed) for seed in range(definitions)]
    return planning.RunPlan(workloads=loaded, choices=planning.resolve(["numpy"], [], []),
                            repeats=cells // definitions, data_source="synthetic")


#: The head declares a node dead after 3 failed health checks 0.5 s apart, not Ray's default 5
#: checks 3 s apart (10 s timeouts): the tests that remove a node mid-cell waited out that
#: default, 20-28 s each. The executor's handling of a lost node is the same either way.
FAST_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_timeout_ms": 500,
              "health_check_failure_threshold": 3}
#: Ray starts its worker processes at niceness 15 (``worker_niceness``), behind its raylet. The
#: simulated nodes share two cores with the suite's other test process, which at 15 left Ray's own
#: processes (Ray Train's controller, a cell's task, its mailbox) a few percent of a core: a Ray
#: Train test took 197 s beside two busy loops at 15, 44 s at 5 (11 s alone). Above 0, it still
#: tests that a cell's worker runs at the normal priority (``ray_node.normal_priority``).
NICENESS = 5


@contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int = 1, env: Optional[dict[str, str]] = None) -> Iterator[Any]:
    """A local Ray cluster of ``nodes`` worker nodes (processes on this machine) behind a head that
    takes no cells, joined by this process; torn down after. ``env`` is in this process's
    environment while the cluster lives, so that every node started meanwhile (the head, these
    nodes, those a test adds) and so every task and actor on it has it. Not a ``runtime_env``: with
    one, Ray starts each worker through its runtime-environment agent and a setup process that
    imports Ray before the worker imports it again (10 core-seconds of the suite's imports)."""
    import ray
    from ray.cluster_utils import Cluster

    config = {**FAST_DEATH, "worker_niceness": NICENESS}
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                "_system_config": config})
        try:
            for _ in range(nodes):
                cluster.add_node(num_cpus=cpus_per_node)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def node_of(ray_worker_pid: int, cluster):
    """The cluster node whose raylet started the Ray worker ``ray_worker_pid``."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(ray_worker_pid).ppid()
    for node in cluster.worker_nodes:
        if node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid == raylet:
            return node
    raise AssertionError(f"no worker node's raylet is {raylet}")
