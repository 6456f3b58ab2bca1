"""The `keras-jax` and `keras-torch` backends: Keras 3 with KERAS_BACKEND chosen before import, so
every cell runs in its own worker process, as `benchbackend run` starts it."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchbackend import backends, checks, launch, workload
from benchbackend.workload import Workload
from conftest import backend_params, missing, spawn_cell

#: Each backend and the framework Keras runs on in it.
FRAMEWORKS = {"keras-jax": "jax", "keras-torch": "torch"}
pytestmark = pytest.mark.slow  # every test here starts a framework's worker or trains one
BACKENDS = backend_params(FRAMEWORKS)


def small(name: str = "mnist", limit: int = 640, epochs: int = 1, **training: Any) -> Workload:
    w = workload.load(name).with_overrides(limit=limit, epochs=epochs)
    return w.model_copy(update={"training": w.training.model_copy(update=training),
                                "inference": w.inference.model_copy(update={"repeats": 1})})


def cell(tmp_path, name: str, w: Workload, parity_steps: int = 0, device: str = "cpu"):
    """(rows, outcome, info) of one cell in a real worker: Keras picks its framework when imported."""
    rows, outcome, info = spawn_cell(tmp_path, w, name, parity_steps=parity_steps, device=device)
    assert outcome.status in ("done", "unavailable"), outcome
    return rows, outcome, info


# cifar10 is Adam, judged at its workload's trajectory_rtol (5e-2; see workloads/cifar10.yaml: 20
# Adam steps on that network are chaotic). The reference computes Adam's step size in float32 as
# Keras does; computed exactly, 20 steps move the trajectory by up to 1e-2.


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("wl", ["mnist", "cifar10"])
def test_forward_parity_and_a_20_step_trajectory_agree_with_the_reference(tmp_path, name, wl):
    w = small(wl)
    rows, _, info = cell(tmp_path, name, w, parity_steps=20)
    assert FRAMEWORKS[name] in info.backend_version, info
    forward, traj = [r for r in rows if r["phase"] == "parity"]
    assert forward["parity_max_rel"] < w.checks.parity_rtol, forward
    assert traj["steps"] == 20 and traj["parity_step"] is None, traj["notes"]
    epochs = [r for r in rows if r["phase"] == "train_epoch"]
    assert len(epochs) == 1 and np.isfinite(epochs[0]["loss"])
    assert checks.cell_status(rows, w)[0] == "ok", checks.cell_status(rows, w)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("lr,status", [(1e12, "nan_loss"), (1e-12, "chance_accuracy")])
def test_broken_training_is_caught(tmp_path, name, lr, status):
    w = small("mnist", limit=256, epochs=2, lr=lr)
    rows, _, _ = cell(tmp_path, name, w)
    assert checks.cell_status(rows, w)[0] == status, [r.get("loss") for r in rows if r["phase"] == "train_epoch"]


@pytest.mark.parametrize("name", BACKENDS)
def test_keras_on_the_wrong_framework_is_unavailable_with_the_reason(tmp_path, name):
    other = "torch" if FRAMEWORKS[name] == "jax" else "jax"
    if missing("keras-" + other):
        pytest.skip(missing("keras-" + other))
    w = small(limit=64)
    env = dict(launch.worker_environ(backends.get(name)), KERAS_BACKEND=other)
    _, outcome, _ = spawn_cell(tmp_path, w, name, env=env, timeout=600)
    assert outcome.status == "unavailable" and f"KERAS_BACKEND={FRAMEWORKS[name]}" in outcome.message, outcome


@pytest.mark.parametrize("name", [p for p in BACKENDS if p.values[0] == "keras-jax"])
def test_a_tpu_that_jax_does_not_see_is_an_unavailable_row(tmp_path, name):
    rows, outcome, _ = cell(tmp_path, name, small(limit=64), device="tpu")
    if outcome.status != "unavailable" and rows:
        pytest.skip("JAX sees a TPU here")
    assert outcome.status == "unavailable" and "TPU" in outcome.message, outcome
    assert not rows
