"""Keras 3 on JAX, data parallel (``--replicas N`` on ``keras.distribution.DataParallel``, issue 22):
replica parity of two XLA CPU devices in a worker forked from a preloaded interpreter, the epoch's
totals and the padded batches against the NumPy reference, batchnorm refused, and each trap that
can be planted in an SPMD engine ending ``parity_mismatch``.

DataParallel has no per-replica code: XLA slices the one global batch by its sharding and reduces
the gradients of the global mean loss. So torch's overlapping shards and summed all-reduce cannot
be written here; their SPMD forms can, and are planted where this engine could get them wrong: the
global batch fed and its loss's scale (``_feed``), and the optimizer (``_compiled``).

The traps are classes of this module, defined only in a keras-jax worker (which imports them by
name), so that this test process never imports keras.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchbackend.backends import registry as backends
from benchbackend.run import checks, launch, plan
from benchbackend.run.messages import Row
from benchbackend.run.plan import Options
from benchbackend.run.preload import Preloaders
from benchbackend.spec import workload
from conftest import ROOT, make_job, requires, run_cell, spawn_cell

pytestmark = [requires("keras-jax"), pytest.mark.slow]

#: 105 samples at a global batch of 32: three full batches and a last one of 9, which two devices
#: cannot split, so it is padded to 10; 4 trajectory steps reach it. Inference batches of 15 and
#: the forward parity's one batch of 7 do not split either. A larger lr than mnist's shows a wrong step.
SAMPLES, BATCH, STEPS = 105, 32, 4


def _workload(batchnorm: bool = False) -> workload.Workload:
    raw = workload.load("mnist").with_overrides(limit=SAMPLES, epochs=1, batch_size=BATCH).model_dump(mode="json")
    raw["training"]["lr"] = 0.05
    raw["inference"].update(batch_size=15, repeats=1)
    raw["checks"]["parity_batch"] = 7
    if batchnorm:
        raw["model"].insert(1, {"type": "batchnorm"})
    return workload.Workload.model_validate(raw)


def _preloaded_cell(tmp_path: Path, w: workload.Workload, preloaders: Preloaders) -> tuple[list[dict], Any]:
    """(rows with the trajectory decided, outcome) of one 2-replica cell, its worker forked from a
    preloader that has imported the adapter (keras, jax) as a run's CPU cells are."""
    spec = backends.get("keras-jax")
    job = make_job(tmp_path, w, "keras-jax", parity_steps=STEPS, options=Options(replicas=2, threads=1))
    assert job.target.endswith("keras.replicas:KerasJaxDataParallelBackend")
    cell = plan.Cell(w, plan.Choice("keras-jax", job.mode, job.precision, replicas=2), 1, 1, 0)
    messages = launch.stream(cell, launch.python_for(spec), launch.worker_environ(spec, "cpu"), job, 600,
                             preloaders=preloaders)
    rows = []
    while True:
        try:
            msg = next(messages)
        except StopIteration as stop:
            return rows, stop.value
        if isinstance(msg, Row):
            row = dict(msg.fields)
            rows.append(checks.trajectory(row, w) if row.get("losses") is not None else row)


@pytest.fixture(scope="module")
def preloaders():
    with Preloaders() as p:
        yield p


def test_two_devices_train_the_single_replica_steps_and_epoch(tmp_path, preloaders):
    w = _workload()
    rows, outcome = _preloaded_cell(tmp_path, w, preloaders)
    assert outcome.status == "done", outcome
    status, message = checks.cell_status(rows, w)
    assert status == "ok", message
    build = next(r for r in rows if r["phase"] == "build")
    # Counted from the model's variables: the forked worker got its 2 devices.
    assert "replicas 2 (keras.distribution.DataParallel over 2 CPU devices)" in build["notes"]
    trajectory = next(r for r in rows if r["phase"] == "parity" and r.get("steps"))
    assert trajectory["steps"] == STEPS and trajectory["parity_step"] is None  # the padded 4th step too
    forward = next(r for r in rows if r["phase"] == "parity" and not r.get("steps"))
    assert forward["samples"] == 7 and forward["parity_max_rel"] < 1e-4  # a padded predict, pads dropped
    # The epoch's totals and the padded predicts are the single-replica ones (NumPy reference).
    _, ref = run_cell(tmp_path, w, "numpy")
    epoch, ref_epoch = (next(r for r in rs if r["phase"] == "train_epoch") for rs in (rows, ref))
    assert epoch["loss"] == pytest.approx(ref_epoch["loss"], rel=1e-5)
    assert epoch["accuracy"] == pytest.approx(ref_epoch["accuracy"], abs=1e-6)  # the pads are no samples
    assert epoch["val_accuracy"] == ref_epoch["val_accuracy"]
    infer, ref_infer = (next(r for r in rs if r["phase"] == "inference") for rs in (rows, ref))
    assert infer["samples"] == ref_infer["samples"] and infer["accuracy"] == ref_infer["accuracy"]


def test_a_batchnorm_network_is_unavailable_saying_why(tmp_path, preloaders):
    rows, outcome = _preloaded_cell(tmp_path, _workload(batchnorm=True), preloaders)
    assert outcome.status == "unavailable" and not rows
    assert "computes batch statistics over the global batch (synchronized)" in outcome.message
    assert "\n" not in outcome.message


# --- the traps: each a plausible SPMD data-parallel bug, planted in the real adapter ---------------

if os.environ.get("KERAS_BACKEND") == "jax":  # a keras-jax worker importing its trap
    from benchbackend.backends.keras.replicas import KerasJaxDataParallelBackend, padded

    class LossTimesN(KerasJaxDataParallelBackend):
        """Summed, not averaged: the replicas' mean losses added up (N times the global mean)."""

        def _feed(self, x, y):
            x, y, *weights = super()._feed(x, y)
            return x, y, (weights[0] if weights else np.ones(len(x), np.float32)) * self.world

    class LrTimesN(KerasJaxDataParallelBackend):
        """The learning rate scaled although --scale-lr was not asked."""

        def _compiled(self, dropout, weights):
            net = super()._compiled(dropout, weights)
            net.model.optimizer.learning_rate = self.workload.training.lr * self.world
            return net

    class DroppedRemainder(KerasJaxDataParallelBackend):
        """A batch cut to a multiple of N so that it shards: its last L % N samples are no replica's."""

        def _feed(self, x, y):
            keep = len(x) - len(x) % self.world
            return x[:keep], y[:keep]

    class CountedPads(KerasJaxDataParallelBackend):
        """Padded but not masked: the pads, copies of the batch's first samples, count twice (the
        SPMD form of overlapping shards)."""

        def _feed(self, x, y):
            x, y, *_ = super()._feed(x, y)
            return x, y, np.ones(padded(len(x), self.world), np.float32)


@pytest.mark.parametrize("trap, step", [("LossTimesN", 1), ("LrTimesN", 2), ("DroppedRemainder", STEPS),
                                        ("CountedPads", STEPS)])
def test_each_planted_trap_is_caught_by_replica_parity(tmp_path, trap, step):
    env = launch.worker_environ(backends.get("keras-jax"), "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env["PYTHONPATH"]])  # this module, by name
    w = _workload()
    rows, outcome, _ = spawn_cell(tmp_path, w, "keras-jax", env=env, target=f"test_replicas_keras:{trap}",
                                  parity_steps=STEPS, options=Options(replicas=2, threads=1))
    assert outcome.status == "done", outcome
    status, message = checks.cell_status(rows, w)
    assert status == "parity_mismatch", (trap, message)
    # A wrong loss shows at once, a wrong update from the second step, a wrong last batch at it.
    assert next(r for r in rows if r.get("steps"))["parity_step"] == step, message
