"""The `keras-jax` and `keras-torch` backends: Keras 3 with KERAS_BACKEND chosen before import, so
every cell runs in its own worker process, as `benchbackend run` starts it."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchbackend.backends import registry as backends
from benchbackend.run import checks, launch
from benchbackend.spec import workload
from benchbackend.spec.workload import Workload
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


#: Run in the backend's worker environment (Keras picks its framework when imported): builds the
#: adapter on mnist, places the arrays by the rule, and reports what it holds and what Keras' own
#: data adapter hands the compiled step from the inputs ``fit`` and ``predict`` were given.
_PLACEMENT_PROBE = """
import json, sys
import numpy as np
import keras
from keras.src.trainers.data_adapters import get_data_adapter
from benchbackend.backends import registry as backends
from benchbackend.data import datasets as data
from benchbackend.spec import model, workload

name, fits = sys.argv[1], sys.argv[2] == "fits"
w = workload.load("mnist").with_overrides(limit=64, epochs=1)
b = backends.get(name).load_class()(w, "cpu", "fit")
if not fits:
    b.free_device_bytes = lambda: 1 << 20
ds = data.load(w, "synthetic")
x_train, x_test = data.normalize(ds.x_train), data.normalize(ds.x_test)
placed = b.place_data(x_train.nbytes + ds.y_train.nbytes + x_test.nbytes)
b.build(model.initial_weights(w))
b.set_data(x_train, ds.y_train)
x = b.to_device(x_test)
given = {}
for method in ("fit", "predict"):
    def record(inputs, *args, _original=getattr(b.model, method), _method=method, **kwargs):
        given[_method] = inputs
        return _original(inputs, *args, **kwargs)
    setattr(b.model, method, record)
loss, acc = b.train_epoch(np.arange(len(ds.y_train)))
probs = b.to_host(b.scores(x, 32))
b.sync()

def kind(a):
    if isinstance(a, np.ndarray):
        return "numpy.ndarray"
    return f"{type(a).__module__.split('.')[0]}.{type(a).__name__}@{a.device}"

def first_batch(inputs):
    adapter = get_data_adapter(inputs, shuffle=False)
    batches = adapter.get_jax_iterator() if keras.backend.backend() == "jax" else iter(adapter.get_torch_dataloader())
    return [kind(t) for t in next(batches)]

print(json.dumps({"placed": placed, "held": [kind(a) for a in (b.x, b.y, x)], "loss": loss,
                  "probs": list(np.asarray(probs).shape), "fit": type(given["fit"]).__name__,
                  "fit_batch": first_batch(given["fit"]), "predict_batch": first_batch(given["predict"])}))
"""


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fits", [True, False], ids=["on-device", "per-batch"])
def test_fit_and_predict_read_arrays_held_on_the_device(name, fits):
    """The data placement rule in Keras 3: the arrays are the framework's tensors on the device,
    and what Keras' data adapter hands the train and predict steps are device tensors too (not
    NumPy arrays, which Keras' array adapter makes of a jax.Array: a copy to the host). Where they
    do not fit, host arrays, each batch copied by Keras inside the clock."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PLACEMENT_PROBE, name, "fits" if fits else "no"],
                         capture_output=True, text=True, timeout=600,
                         env=launch.worker_environ(backends.get(name)))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    device = {"keras-jax": "jaxlib.ArrayImpl@cpu:0", "keras-torch": "torch.Tensor@cpu"}[name]
    if fits:
        assert got["held"] == [device] * 3, got
        assert got["fit_batch"] == [device] * 2 and got["predict_batch"] == [device], got
    else:
        assert got["held"] == ["numpy.ndarray"] * 3, got
    assert got["placed"] is fits and got["fit"] == "_Batches" and np.isfinite(got["loss"]), got
    assert got["probs"] == [256, 10], got
