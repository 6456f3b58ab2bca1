"""JAX data parallel (``--replicas N``, issue 22): the batch sharded over N host devices with
``jax.shard_map``, held to ``benchbackend.spec.replicas``. An honest 2-replica cell (through a
preloaded, forked worker, as ``run`` starts CPU cells), a batchnorm one and one with fewer samples
than replicas in the last batch end ``ok`` with replica parity; each planted trap (summed
gradients, lr times N, overlapping shards, a dropped remainder) ends ``parity_mismatch``.

Each replica cell runs in a worker process of its own: JAX's host devices are fixed when its CPU
backend starts, which in this process another test may have done already. The trap adapters are
classes of this module, which the workers import by name (``PYTHONPATH`` names this folder)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import replica_traps

from benchbackend.backends import registry as backends
from benchbackend.data.datasets import normalize
from benchbackend.run import checks, launch, plan, truth
from benchbackend.run.messages import Info, Row
from benchbackend.run.preload import Preloaders
from benchbackend.spec import replicas, workload
from benchbackend.spec.model import initial_weights
from conftest import make_job, requires, run_cell

pytestmark = [requires("jax"), pytest.mark.slow]

#: 105 samples at a global batch of 32: three full batches and a last one of 9, which two replicas
#: split 5 + 4 (weights 10/9 and 8/9); 4 trajectory steps reach it. lr 0.05 makes a wrong step show.
SAMPLES, BATCH, STEPS = 105, 32, 4
HERE = Path(__file__).resolve().parent


def _workload(lr: float = 0.05, batchnorm: bool = False, samples: int = SAMPLES) -> workload.Workload:
    w = workload.load("mnist").with_overrides(limit=samples, epochs=1, batch_size=BATCH)
    w = w.model_copy(update={"training": w.training.model_copy(update={"lr": lr}),
                             "inference": w.inference.model_copy(update={"repeats": 1})})
    if batchnorm:
        raw = w.model_dump(mode="json")
        raw["model"].insert(1, {"type": "batchnorm"})
        w = workload.Workload.model_validate(raw)
    return w


def _cell(tmp_path: Path, w, n: int = 2, target: str | None = None, mode: str = "jit",
          preloaders: Preloaders | None = None) -> tuple[str, str, list[dict], list[dict], object]:
    """(status, message, rows with the trajectory decided, raw rows, the worker's Info) of one jax
    cell of ``n`` replicas in a worker process (forked from ``preloaders`` if given)."""
    options = plan.Options(replicas=n, threads=1, peak_tflops=1.0, steps_per_execution=2)
    job = make_job(tmp_path, w, "jax", mode=mode, parity_steps=STEPS, options=options,
                   **({"target": f"test_replicas_jax:{target}"} if target else {}))
    spec = backends.get("jax")
    env = launch.worker_environ(spec, "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    cell = plan.Cell(w, plan.Choice("jax", job.mode, job.precision), job.repeat, 1, 0)
    messages = launch.stream(cell, sys.executable, env, job, 600, preloaders=preloaders)
    raw, info = [], None
    while True:
        try:
            msg = next(messages)
        except StopIteration as stop:
            assert stop.value.status == "done", stop.value
            break
        raw += [dict(msg.fields)] if isinstance(msg, Row) else []
        info = msg if isinstance(msg, Info) else info
    rows = [checks.trajectory(r, w) if r.get("losses") is not None else r for r in raw]
    status, message = checks.cell_status(rows, w)
    return status, message, rows, raw, info


def _trajectory(rows: list[dict]) -> dict:
    return next(r for r in rows if r.get("phase") == "parity" and r.get("steps"))


# --- the layout, no device ---------------------------------------------------------------------------


def test_the_layout_pads_each_shard_to_the_largest_and_keeps_every_sample_once():
    from benchbackend.backends.jax.sharding import layout

    def split(size):
        return [(a, b, w) for (a, b), w in zip(replicas.shards(size, 2), replicas.weights(size, 2))]

    order = np.arange(100, 141)  # 41 samples: a full batch of 32, then 9 (5 + 4)
    idx, offsets, plans = layout(order, [(0, 32), (32, 9)], split, 2)
    assert offsets == [0, 16] and [p.rows for p in plans] == [16, 5]
    assert plans[0].counts == (16, 16) and plans[0].weights == (1.0, 1.0)
    assert plans[1].counts == (5, 4) and plans[1].weights == pytest.approx((10 / 9, 8 / 9))
    r0, r1 = idx[:21], idx[21:]  # each replica's segment: its blocks, one per global batch
    assert r0.tolist() == list(range(100, 116)) + list(range(132, 137))
    assert r1[:16].tolist() == list(range(116, 132)) and r1[16:20].tolist() == list(range(137, 141))
    assert r1[20] == 132  # the pad (the batch's first sample), which replica 1's branch never reads
    # Fewer samples than replicas: a block of one stand-in row for the replica left without a sample.
    idx, _, (one,) = layout(order, [(40, 1)], split, 2)
    assert one.counts == (1, 0) and one.weights == (2.0, 0.0) and idx.tolist() == [140, 140]


# --- real shard_map cells: replica parity and its traps ----------------------------------------------


class Recorded:
    """Mixed into the honest adapter: the build row's notes name the worker's parent process, so
    the test can tell a worker forked by a preloader from one it started itself."""

    def details(self):
        return {**super().details(), "parent": str(os.getppid())}


try:
    from jax import lax

    from benchbackend.backends.jax.replicas import AXIS, JaxShardedBackend
except ImportError:  # jax absent: the tests that use them skip
    JaxShardedBackend = object


class Forked(Recorded, JaxShardedBackend):
    pass


def test_two_replicas_in_a_preloaded_worker_train_the_single_replica_network(tmp_path):
    w = _workload()
    with Preloaders() as preloaders:
        status, message, rows, _, info = _cell(tmp_path, w, target="Forked", preloaders=preloaders)
    assert status == "ok", message
    build = next(r for r in rows if r["phase"] == "build")
    assert "replicas 2 (shard_map over 2 CPU devices, pmean)" in build["notes"]
    assert f"parent {os.getpid()}" not in build["notes"]  # forked by the preloader, not started here
    assert info is not None and info.device == "cpu"
    trajectory = _trajectory(rows)
    assert trajectory["parity_step"] is None and trajectory["steps"] == STEPS  # the short 5 + 4 batch included
    # Every sample once per epoch, the short last batch included: the epoch's loss and accuracy are
    # the single-replica run's (in this process: one replica needs no second device).
    _, single = run_cell(tmp_path, w, "jax", options=plan.Options(peak_tflops=1.0))
    e1, e2 = (next(r for r in c if r["phase"] == "train_epoch") for c in (single, rows))
    assert e2["loss"] == pytest.approx(e1["loss"], rel=1e-5) and e2["accuracy"] == pytest.approx(e1["accuracy"])
    assert e2["samples"] == SAMPLES


def test_scan_with_fewer_samples_than_replicas_in_the_last_batch(tmp_path):
    # 97 samples over 4 replicas: the last global batch is one sample, so three replicas join its
    # step with a zero-weighted stand-in; scan runs the full batches two per dispatch.
    status, message, rows, _, _ = _cell(tmp_path, _workload(samples=97), n=4, mode="scan")
    assert status in ("ok", "chance_accuracy"), message  # 97 synthetic samples may learn nothing
    assert _trajectory(rows)["parity_step"] is None and _trajectory(rows)["steps"] == STEPS, message
    assert next(r for r in rows if r["phase"] == "train_epoch")["samples"] == 97


def test_batchnorm_uses_per_replica_statistics_and_the_reference_does_too(tmp_path):
    w = _workload(lr=0.01, batchnorm=True)
    status, message, rows, raw, _ = _cell(tmp_path, w)
    assert status == "ok", message
    # The check means something: statistics over the global batch (jit on a sharded batch, a
    # SyncBN) would follow the single-replica trajectory, which this one leaves.
    with np.load(make_job(tmp_path, w, "jax").data) as z:
        x, y, order = normalize(z["x_train"]), z["y_train"], z["orders"][0]
    batches = [(x[order[i * BATCH:(i + 1) * BATCH]], y[order[i * BATCH:(i + 1) * BATCH]]) for i in range(STEPS)]
    single = truth.trajectory(w, initial_weights(w, 1), batches)
    got = next(r for r in raw if r.get("losses") is not None)
    assert checks.trajectory({**got, "reference_losses": single}, w)["parity_step"] is not None


class SummedGradients(JaxShardedBackend):
    def _reduce(self, grads):
        return [lax.psum(g, AXIS) for g in grads]


class LrTimesN(JaxShardedBackend):
    def _lr(self):
        return super()._lr() * self.world  # scaled although --scale-lr was not asked


class OverlappingShards(JaxShardedBackend):
    def _split(self, size):
        return replica_traps.overlapping(size, self.world)


class DroppedRemainder(JaxShardedBackend):
    def _split(self, size):
        return replica_traps.dropped_remainder(size, self.world)


@pytest.mark.parametrize("trap", ["SummedGradients", "LrTimesN", "OverlappingShards", "DroppedRemainder"])
def test_each_planted_trap_is_caught_by_replica_parity(tmp_path, trap):
    status, message, rows, _, _ = _cell(tmp_path, _workload(), target=trap)
    assert status == "parity_mismatch", (trap, message)
    step = _trajectory(rows)["parity_step"]
    # A wrong update shows from the second step on; the dropped remainder only at the short last batch.
    expected = {"SummedGradients": 2, "LrTimesN": 2, "DroppedRemainder": STEPS}
    assert step == expected.get(trap, step) and step is not None, (trap, message)


def test_a_process_whose_cpu_backend_started_with_one_device_is_unavailable_in_one_line():
    script = ("import jax; jax.devices()\n"
              "from benchbackend.spec import workload\n"
              "from benchbackend.errors import BackendUnavailable\n"
              "from benchbackend.backends.jax.replicas import JaxShardedBackend\n"
              "try:\n"
              "    JaxShardedBackend(workload.load('mnist'), 'cpu', options={'replicas': 2})\n"
              "except BackendUnavailable as exc:\n"
              "    print(exc)\n")
    env = dict(os.environ, **backends.get("jax").env("cpu"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=HERE.parent)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("jax: --replicas 2 needs 2 CPU devices; JAX's CPU backend in this process started "
                               "with 1"), lines
