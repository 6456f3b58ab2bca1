"""The data placement rule (DESIGN.md "The Backend contract"; ``Backend.place_data``) in the adapters
that run in this process: the arrays on the device before the clock where they fit, else host
arrays with each batch copied inside the clock, and the same numbers either way.

A CPU holds every array, so the copied-per-batch path is reached here by a framework that reports
too little free memory (``free_device_bytes``). The Keras adapters (a framework chosen before
import) are tested in ``test_keras3.py``, ONNX Runtime in ``test_onnx_runtimes.py``; the worker's
side (the copy timed in ``build``) in ``test_timed_regions.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from benchbackend.backends import registry as backends
from benchbackend.data import datasets as data
from benchbackend.spec import model, workload
from conftest import requires

pytestmark = pytest.mark.slow  # each test builds and trains a framework's network


def _adapter(name: str, mode: str, fits: bool, monkeypatch: pytest.MonkeyPatch):
    """(adapter built on mnist's shared weights, its arrays placed, the test split placed)."""
    spec = backends.get(name)
    w = workload.load("mnist").with_overrides(limit=100, epochs=1)
    w = w.model_copy(update={"training": w.training.model_copy(update={"batch_size": 16})})
    b = spec.load_class()(w, "cpu", mode, "fp32", {"steps_per_execution": 4})
    if not fits:
        monkeypatch.setattr(b, "free_device_bytes", lambda: 1 << 20)  # 1 MiB: mnist's arrays need more
    ds = data.load(w, "synthetic")
    x_train, x_test = data.normalize(ds.x_train), data.normalize(ds.x_test)
    assert b.place_data(x_train.nbytes + ds.y_train.nbytes + x_test.nbytes) is fits
    b.build(model.initial_weights(w))
    b.set_data(x_train, ds.y_train)
    return b, b.to_device(x_test), ds


#: (backend, mode); jax's scan runs blocks of 4 steps, then single steps, then a short batch.
CASES = [pytest.param(n, m, marks=requires(n), id=f"{n}-{m}") for n, m in (
    ("numpy", "reference"), ("torch", "eager"), ("tensorflow", "tf.function"), ("jax", "jit"), ("jax", "scan"))]


@pytest.mark.parametrize("name, mode", CASES)
def test_an_epoch_and_a_pass_agree_whether_the_arrays_are_on_the_device_or_copied_per_batch(name, mode, monkeypatch):
    """The same epoch (same order, same dropout keys where the framework makes them reproducible)
    and the same scores from arrays held on the device and from host arrays fed batch by batch."""
    results = []
    for fits in (True, False):
        if name == "torch":
            import torch

            torch.manual_seed(0)  # dropout masks
        b, x_test, ds = _adapter(name, mode, fits, monkeypatch)
        assert b.data_on_device is fits and (fits or "exceed half of the 1 MiB free" in b.data_note)
        order = np.random.default_rng(3).permutation(len(ds.y_train))
        loss, acc = (float(b.to_host(v)) for v in b.train_epoch(order))
        probs = np.asarray(b.to_host(b.scores(x_test, 32)))
        b.sync()
        results.append((loss, acc, probs))
    (loss_on, acc_on, probs_on), (loss_off, acc_off, probs_off) = results
    assert np.isfinite(loss_off) and probs_off.shape == (len(ds.y_test), 10)
    if name != "tensorflow":  # Keras' dropout on TensorFlow draws from a fresh seed per model
        assert (loss_off, acc_off) == pytest.approx((loss_on, acc_on), rel=1e-5)
        np.testing.assert_allclose(probs_off, probs_on, rtol=1e-5, atol=1e-6)


@requires("jax")
def test_jax_holds_device_arrays_or_host_arrays_by_the_rule(monkeypatch):
    """On the device: jax.Arrays on the cell's device; copied per batch: NumPy arrays."""
    import jax

    on, x_on, _ = _adapter("jax", "jit", True, monkeypatch)
    off, x_off, _ = _adapter("jax", "jit", False, monkeypatch)
    assert all(isinstance(a, jax.Array) for a in (on.x, on.y, x_on)) and x_on.devices() == {on.device}
    assert all(isinstance(a, np.ndarray) for a in (off.x, off.y, x_off))
