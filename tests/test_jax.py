"""The `jax` backend: parity and trajectory against the reference, broken training caught, `scan`
trains exactly as `jit`, a missing TPU is `unavailable`, and results stay lazy until the worker syncs."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from benchbackend.data import datasets as data
from benchbackend.run import checks, timing
from benchbackend.run.plan import Options
from benchbackend.spec import model, workload
from benchbackend.spec.workload import Workload
from conftest import requires, run_cell

pytestmark = [requires("jax"), pytest.mark.slow]


def small(name: str = "mnist", limit: int = 640, epochs: int = 1, repeats: int = 1, **training: Any) -> Workload:
    w = workload.load(name).with_overrides(limit=limit, epochs=epochs)
    return w.model_copy(update={"training": w.training.model_copy(update=training),
                                "inference": w.inference.model_copy(update={"repeats": repeats})})


def run(tmp_path, w: Workload, mode: str = "jit", device: str = "cpu", parity_steps: int = 0,
        options: Options | None = None) -> tuple[list[dict], list[dict]]:
    """(all messages, rows with the trajectory decided) of one in-process cell."""
    return run_cell(tmp_path, w, "jax", mode=mode, device=device, parity_steps=parity_steps,
                    options=options or Options())


def arrays(w: Workload) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    ds = data.load(w, "synthetic")
    return data.normalize(ds.x_train), ds.y_train, data.epoch_orders(len(ds.y_train), w.training.epochs, w.seed)


# cifar10 (Adam) is judged at its workload's trajectory_rtol, 5e-2: 20 Adam steps on its ReLU/max-pool
# network are chaotic (see workloads/cifar10.yaml); mnist (SGD) at the default 1e-3.
@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_forward_parity_and_a_20_step_trajectory_agree_with_the_reference(tmp_path, name):
    w = small(name)
    _, rows = run(tmp_path, w, parity_steps=20)
    forward, traj = [r for r in rows if r["phase"] == "parity"]
    assert forward["parity_max_rel"] < w.checks.parity_rtol, forward
    assert traj["steps"] == 20 and traj["parity_step"] is None, traj["notes"]
    assert checks.cell_status(rows, w)[0] == "ok", checks.cell_status(rows, w)


@pytest.mark.parametrize("name,factor", [("mnist", 1.5), ("cifar10", 1.1)])
def test_the_trajectory_check_catches_a_wrong_update_rule(tmp_path, monkeypatch, name, factor):
    import benchbackend.backends.jax.adapter as jb

    real = jb._update
    # An update rule that steps too far (the workload's lr is right; the rule is not). On cifar10,
    # 10% too far is caught despite the chaos that the 5e-2 tolerance allows for.
    monkeypatch.setattr(jb, "_update", lambda opt, lr, *rest, **kw: real(opt, lr * factor, *rest, **kw))
    w = small(name)
    _, rows = run(tmp_path, w, parity_steps=20)
    traj = [r for r in rows if r["phase"] == "parity"][1]
    assert traj["parity_step"] is not None, traj
    assert checks.cell_status(rows, w)[0] == "parity_mismatch"


@pytest.mark.parametrize("lr,status", [(1e12, "nan_loss"), (1e-12, "chance_accuracy")])
def test_broken_training_is_caught(tmp_path, lr, status):
    w = small("mnist", limit=256, epochs=2, lr=lr)
    _, rows = run(tmp_path, w)
    assert checks.cell_status(rows, w)[0] == status, [r.get("loss") for r in rows if r["phase"] == "train_epoch"]


def with_dropout(w: Workload) -> Workload:
    """cifar10's data and Adam with a small network that has dropout (the full cifar10 CNN costs
    XLA:CPU about 5 s to compile per step function, and what is tested is the dropout keys)."""
    layers = [{"type": "conv2d", "filters": 4, "kernel_size": 3, "activation": "relu"},
              {"type": "maxpool2d", "pool_size": 4}, {"type": "dropout", "rate": 0.25}, {"type": "flatten"},
              {"type": "dense", "units": 10, "activation": "softmax"}]
    return Workload.model_validate({**w.to_dict(), "name": "cifar10-dropout", "model": layers})


# 300 samples at batch 32: 9 full batches and one of 12; K=7: a block of 7, then 2 single steps.
@pytest.mark.parametrize("name", ["mnist", "cifar10-dropout"])
def test_scan_trains_exactly_as_jit_with_a_partial_block_and_a_short_batch(name):
    from benchbackend.backends.jax.adapter import JaxBackend

    w = small(name.removesuffix("-dropout"), limit=300, epochs=2)
    w = with_dropout(w) if name.endswith("-dropout") else w
    x, y, orders = arrays(w)
    weights = model.initial_weights(w, 1)
    results = {}
    for mode in ("jit", "scan"):
        b = JaxBackend(w, "cpu", mode, "fp32", {"steps_per_execution": 7})
        b.build(weights)
        b.set_data(x, y)
        epochs = [tuple(float(v) for v in b.to_host(b.train_epoch(order))) for order in orders]
        results[mode] = (np.array(epochs), b.get_weights())
    (jit_epochs, jit_w), (scan_epochs, scan_w) = results["jit"], results["scan"]
    np.testing.assert_allclose(scan_epochs, jit_epochs, rtol=1e-5)
    for a, b_ in zip(scan_w, jit_w):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-6)


def test_scan_scores_match_jit_scores():
    from benchbackend.backends.jax.adapter import JaxBackend

    w = small("mnist", limit=256)
    weights = model.initial_weights(w, 1)
    x = arrays(w)[0][:250]  # 250 at batch 16, K=3: 5 blocks of 3 batches, 0 single, a short batch of 10
    out = {}
    for mode in ("jit", "scan"):
        b = JaxBackend(w, "cpu", mode, "fp32", {"steps_per_execution": 3})
        b.build(weights)
        out[mode] = b.to_host(b.scores(b.to_device(x), 16))
    assert out["scan"].shape == (250, w.num_classes)
    np.testing.assert_allclose(out["scan"], out["jit"], rtol=1e-5, atol=1e-7)


def test_threads_size_xlas_cpu_pool(monkeypatch):
    """``--threads`` reaches XLA: its CPU client sizes its one pool from ``PJRT_NPROC`` when the
    backend starts (the OpenMP/MKL variables --threads also sets, it ignores: a 1-thread cell ran on
    every core), and ``threads()`` (the threads column) reads the pool back, per replica."""
    from benchbackend.backends.jax.adapter import JaxBackend

    monkeypatch.delenv("PJRT_NPROC", raising=False)
    assert JaxBackend(small(), "cpu", options=Options(threads=1)).threads() == 1
    assert os.environ["PJRT_NPROC"] == "1"
    assert JaxBackend(small(), "cpu", options=Options(threads=1, replicas=2)).threads() == 1
    assert os.environ["PJRT_NPROC"] == "2"  # the replicas share the one pool


def test_a_tpu_that_jax_does_not_see_is_an_unavailable_row(tmp_path):
    import jax

    try:
        jax.devices("tpu")
        pytest.skip("JAX sees a TPU here")
    except RuntimeError:
        pass
    msgs, rows = run(tmp_path, small(limit=64), device="tpu")
    unavailable = [m for m in msgs if m.get("type") == "unavailable"]
    assert unavailable and "TPU" in unavailable[0]["message"] and "jax[tpu]" in unavailable[0]["message"], msgs
    assert not rows


def test_an_unknown_device_is_unavailable():
    from benchbackend.backends.jax.adapter import JaxBackend
    from benchbackend.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="jax: unknown device 'opencl'"):
        JaxBackend(small(), "opencl", "jit")


def test_scores_and_epochs_stay_on_the_device_until_the_worker_fetches_them():
    """Lazy-safe: ``scores``/``train_epoch`` fetch nothing to the host (a device-to-host transfer
    would raise under the guard), and the worker's ``to_host`` + ``sync`` complete them."""
    import jax

    from benchbackend.backends.jax.adapter import JaxBackend

    w = small("mnist", limit=256)
    x, y, orders = arrays(w)
    b = JaxBackend(w, "cpu", "scan", "fp32", {"steps_per_execution": 4})
    b.build(model.initial_weights(w, 1))
    b.set_data(x, y)
    xd = b.to_device(x)
    with jax.transfer_guard_device_to_host("disallow"):
        loss, acc = b.train_epoch(orders[0])
        probs = b.scores(xd, 32)
    assert all(isinstance(v, jax.Array) for v in (loss, acc, probs))
    (host, seconds) = timing.timed_region(lambda: b.scores(xd, 32), b.to_host, b.sync)
    assert isinstance(host, np.ndarray) and host.shape == (len(x), w.num_classes) and seconds > 0
    b.sync()
    assert probs.is_ready() and loss.is_ready()
    assert 0.0 <= float(acc) <= 1.0 and np.isfinite(float(loss))
