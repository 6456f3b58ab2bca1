"""The `keras-jax` and `keras-torch` backends: Keras 3 with KERAS_BACKEND chosen before import, so
every cell runs in its own worker process, as `benchbackend run` starts it."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

import numpy as np
import pytest

from benchbackend import backends, checks, launch, runner, workload
from benchbackend.workload import Workload
from conftest import job_arrays


def _missing(*modules: str) -> str:
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(gone)} not installed (pip install 'benchbackend[keras3]')" if gone else ""


FRAMEWORKS = {"keras-jax": ("jax", "benchbackend.backends.keras3:KerasJaxBackend"),
              "keras-torch": ("torch", "benchbackend.backends.keras3:KerasTorchBackend")}
BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(bool(_missing("keras", fw)), reason=_missing("keras", fw)))
            for name, (fw, _) in FRAMEWORKS.items()]


def small(name: str = "mnist", limit: int = 640, epochs: int = 1, **training: Any) -> Workload:
    w = workload.load(name).with_overrides(limit=limit, epochs=epochs)
    return w.model_copy(update={"training": w.training.model_copy(update=training),
                                "inference": w.inference.model_copy(update={"repeats": 1})})


def env_for(name: str, device: str = "cpu") -> dict[str, str]:
    """The worker environment `run` gives this backend (its registry entry's variables)."""
    if name in backends.BACKENDS:
        return runner.worker_environ(backends.BACKENDS[name], device)
    # Not registered yet: the variables its registry entry sets.
    fw = FRAMEWORKS[name][0]
    extra = {"KERAS_BACKEND": fw}
    if fw == "jax" and device == "cpu":
        extra["JAX_PLATFORMS"] = "cpu"
    if fw == "torch":
        extra["KERAS_TORCH_DEVICE"] = "cpu" if device == "cpu" else "cuda"
    return runner.worker_environ(backends.BackendSpec(name, FRAMEWORKS[name][1], "keras", "keras", "", "",
                                                      modes=(backends.Mode("fit", ""),),
                                                      env=lambda d: extra), device)


def cell(tmp_path, name: str, w: Workload, parity_steps: int = 0, device: str = "cpu") -> tuple[list[dict], list[dict]]:
    job = {"workload": w.to_dict(), "backend": name, "target": FRAMEWORKS[name][1], "mode": "fit",
           "precision": "fp32", "device": device, "repeat": 1, "data": job_arrays(tmp_path, w), "trains": True,
           "parity_steps": parity_steps, "options": {}}
    msgs: list[dict] = []
    outcome = launch.run_worker(sys.executable, env_for(name, device), job, msgs.append, timeout=900)
    assert outcome.status in ("done", "unavailable"), outcome
    rows = [checks.trajectory(m, w) if m.get("losses") is not None else m for m in msgs if m.get("type") == "row"]
    return msgs, rows


# cifar10 is Adam, judged at its workload's trajectory_rtol (5e-2; see workloads/cifar10.yaml: 20
# Adam steps on that network are chaotic). The reference computes Adam's step size in float32 as
# Keras does; computed exactly, 20 steps move the trajectory by up to 1e-2.


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("wl", ["mnist", "cifar10"])
def test_forward_parity_and_a_20_step_trajectory_agree_with_the_reference(tmp_path, name, wl):
    w = small(wl)
    msgs, rows = cell(tmp_path, name, w, parity_steps=20)
    info = next(m for m in msgs if m.get("type") == "info")
    assert FRAMEWORKS[name][0] in info["backend_version"] and info["mode"] == "fit", info
    forward, traj = [r for r in rows if r["phase"] == "parity"]
    assert forward["parity_max_rel"] < w.checks.parity_rtol, forward
    assert traj["steps"] == 20 and traj["parity_step"] is None, traj["message"]
    epochs = [r for r in rows if r["phase"] == "train_epoch"]
    assert len(epochs) == 1 and np.isfinite(epochs[0]["loss"])
    assert checks.cell_status(rows, w)[0] == "ok", checks.cell_status(rows, w)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("lr,status", [(1e12, "nan_loss"), (1e-12, "chance_accuracy")])
def test_broken_training_is_caught(tmp_path, name, lr, status):
    w = small("mnist", limit=256, epochs=2, lr=lr)
    _, rows = cell(tmp_path, name, w)
    assert checks.cell_status(rows, w)[0] == status, [r.get("loss") for r in rows if r["phase"] == "train_epoch"]


@pytest.mark.parametrize("name", BACKENDS)
def test_keras_on_the_wrong_framework_is_unavailable_with_the_reason(tmp_path, name):
    other = "torch" if FRAMEWORKS[name][0] == "jax" else "jax"
    if _missing(other):
        pytest.skip(_missing(other))
    w = small(limit=64)
    job = {"workload": w.to_dict(), "backend": name, "target": FRAMEWORKS[name][1], "mode": "fit", "device": "cpu",
           "repeat": 1, "data": job_arrays(tmp_path, w), "trains": True}
    msgs: list[dict] = []
    launch.run_worker(sys.executable, dict(env_for(name), KERAS_BACKEND=other), job, msgs.append, timeout=600)
    unavailable = [m for m in msgs if m.get("type") == "unavailable"]
    assert unavailable and f"KERAS_BACKEND={FRAMEWORKS[name][0]}" in unavailable[0]["message"], msgs


@pytest.mark.parametrize("name", [p for p in BACKENDS if p.values[0] == "keras-jax"])
def test_a_tpu_that_jax_does_not_see_is_an_unavailable_row(tmp_path, name):
    msgs, rows = cell(tmp_path, name, small(limit=64), device="tpu")
    unavailable = [m for m in msgs if m.get("type") == "unavailable"]
    if not unavailable and rows:
        pytest.skip("JAX sees a TPU here")
    assert unavailable and "TPU" in unavailable[0]["message"], msgs
    assert not rows
