"""The worker ends every timed region (DESIGN.md, "The Backend contract"): the adapter's call, its
result brought to the host with ``to_host``, ``sync()``, and only then the clock.

The cells here run test-only backends (``support.lazy_backend``) on a simulated device in this
process, with ``timing.clock`` replaced by a virtual clock that only the device's work advances.
Each ``train_epoch`` and ``inference`` region must then read exactly the device's seconds: a worker
that drops the sync, or that fetches the result after reading the clock, reads 0; so does an
adapter whose ``to_host`` hands back a value still being computed. No sleeping, no threshold
against the host's own speed.
"""
from __future__ import annotations

import numpy as np
import pytest
from support import lazy_backend
from support.lazy_backend import COPY_SECONDS, DEVICE_SECONDS

from benchbackend.backends import registry as backends
from benchbackend.data import datasets as data
from benchbackend.run import timing
from benchbackend.spec import model, workload
from conftest import backend_params, run_cell


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> lazy_backend.VirtualClock:
    clock = lazy_backend.VirtualClock()
    monkeypatch.setattr(lazy_backend, "CLOCK", clock)
    monkeypatch.setattr(timing, "clock", clock)
    return clock


@pytest.mark.parametrize("device", ["SyncDevice", "ToHostDevice"])
def test_every_timed_region_ends_after_the_device_work(device, tmp_path, virtual_clock):
    """``SyncDevice``: the work is waited for by ``sync`` only. ``ToHostDevice``: results are
    lazy, and the work is paid when ``to_host`` fetches them."""
    w = workload.load("mnist").with_overrides(limit=64, epochs=2)
    msgs, _ = run_cell(tmp_path, w, "numpy", target=f"support.lazy_backend:{device}")
    assert not [m for m in msgs if m.get("type") in ("error", "unavailable")], msgs
    timed = [(m["phase"], m["seconds"]) for m in msgs if m.get("phase") in ("train_epoch", "inference")]
    assert [p for p, _ in timed] == ["train_epoch"] * 2 + ["inference"] * w.inference.repeats
    # The clock moves only with the device: each region read exactly the work it had to wait for.
    assert [s for _, s in timed] == pytest.approx([DEVICE_SECONDS] * len(timed)), timed
    assert virtual_clock() > 0


def test_compile_time_is_the_first_epoch_and_pass_less_a_steady_one(tmp_path, virtual_clock):
    """Issue 40 item 3: a device whose first step at each shape compiles for ``COMPILE_SECONDS``
    (``CompilingDevice``). The second epoch's row and the second pass's say exactly that much
    ``compile_s`` (the parity and validation passes compiled their own batch size, not the timed
    one); ``first_result_s`` counts from the process's start (here the cell's) to the end of the
    first step: the wall seconds before epoch 1 began (0 to this test's own), then the compile and
    one step of the epoch's at the steady speed. An inference-only cell: its passes say both."""
    import time

    from support.lazy_backend import COMPILE_SECONDS

    w = workload.load("mnist").with_overrides(limit=64, epochs=3)
    steps = -(-64 // w.training.batch_size)
    wall = time.time()
    msgs, rows = run_cell(tmp_path, w, "numpy", target="support.lazy_backend:CompilingDevice")
    wall = time.time() - wall
    assert not [m for m in msgs if m.get("type") in ("error", "unavailable")], msgs
    epochs = [r for r in rows if r["phase"] == "train_epoch"]
    passes = [r for r in rows if r["phase"] == "inference"]
    assert [e["seconds"] for e in epochs] == pytest.approx([DEVICE_SECONDS + COMPILE_SECONDS] + 2 * [DEVICE_SECONDS])
    assert [("compile_s" in e, "first_result_s" in e) for e in epochs] == [(False, False), (True, True),
                                                                           (False, False)]
    assert epochs[1]["compile_s"] == pytest.approx(COMPILE_SECONDS)
    first_step = COMPILE_SECONDS + DEVICE_SECONDS / steps
    assert first_step - 1e-9 <= epochs[1]["first_result_s"] <= first_step + wall
    assert passes[1]["compile_s"] == pytest.approx(COMPILE_SECONDS) and "first_result_s" not in passes[1]
    assert not any("compile_s" in p for i, p in enumerate(passes) if i != 1)

    _, rows = run_cell(tmp_path, w, "numpy", target="support.lazy_backend:CompilingDevice", trains=False)
    passes = [r for r in rows if r["phase"] == "inference"]  # inference only: its first pass holds the first result
    assert not [r for r in rows if r["phase"] == "train_epoch"]
    assert passes[1]["compile_s"] == pytest.approx(COMPILE_SECONDS) and passes[1]["first_result_s"] > COMPILE_SECONDS


def test_first_dispatch_arithmetic():
    """``timing.FirstDispatch`` on given times: a process started at 100 s, epoch 1 began at 103 s and
    took 12 s over 4 steps, epoch 2 took 4 s (1 s a step): compile 8 s; the first step ended 3 + 12
    - 3 x 1 = 12 s after the start. The inference after it (3 s then 1 s) has compile 2 s only."""
    seen = timing.FirstDispatch(100.0)
    assert seen.see("train", 1, 103.0, 12.0, 4) == {}
    assert seen.see("train", 2, 116.0, 4.0, 4) == {"compile_s": 8.0, "first_result_s": 12.0}
    assert seen.see("train", 3, 121.0, 4.0, 4) == {}
    assert seen.see("inference", 1, 130.0, 3.0, 2) == {}
    assert seen.see("inference", 2, 133.0, 1.0, 2) == {"compile_s": 2.0}
    checked = timing.FirstDispatch(100.0)
    checked.exclude(1.5)  # a GEMM probe, say, before the first epoch
    checked.see("train", 1, 103.0, 12.0, 4)
    assert checked.see("train", 2, 116.0, 4.0, 4)["first_result_s"] == 10.5
    alone = timing.FirstDispatch(None)  # the process's start unknown: no first result
    alone.see("inference", 1, 5.0, 3.0, 2)
    assert alone.see("inference", 2, 8.0, 1.0, 2) == {"compile_s": 2.0}


def test_the_copy_of_the_arrays_to_the_device_is_timed_in_build_and_in_no_epoch_or_pass(tmp_path, virtual_clock):
    """The data placement rule: the training arrays (``set_data``) and the splits that validation
    and inference read (``to_device``) go to the device inside the ``build`` row's region, which
    waits for the copies; each epoch and pass then reads its own work only."""
    w = workload.load("mnist").with_overrides(limit=64, epochs=2)
    msgs, _ = run_cell(tmp_path, w, "numpy", target="support.lazy_backend:PlacingDevice")
    assert not [m for m in msgs if m.get("type") in ("error", "unavailable")], msgs
    info = next(m for m in msgs if m.get("type") == "info")
    assert info["data_on_device"] is True  # host memory: the arrays always fit
    build = next(m for m in msgs if m.get("phase") == "build")
    assert "data copied per batch" not in build["notes"]
    assert build["seconds"] == pytest.approx(3 * COPY_SECONDS)  # x_train (+ labels), x_val, x_test
    timed = [m["seconds"] for m in msgs if m.get("phase") in ("train_epoch", "inference")]
    assert len(timed) == 2 + w.inference.repeats
    assert timed == pytest.approx([DEVICE_SECONDS] * len(timed))


def test_arrays_that_do_not_fit_are_copied_per_batch_and_the_build_row_says_why(tmp_path, monkeypatch):
    """Where the framework reports less free device memory than twice the arrays, the cell runs
    with host arrays (each batch copied in the clock), ``data_on_device`` False and the reason noted."""
    from benchbackend.backends.numpy.reference import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "free_device_bytes", lambda self: 1000)
    w = workload.load("mnist").with_overrides(limit=64, epochs=1)
    msgs, rows = run_cell(tmp_path, w, "numpy")
    info = next(m for m in msgs if m.get("type") == "info")
    build = next(m for m in rows if m["phase"] == "build")
    assert info["data_on_device"] is False and "exceed half of the 0 MiB free" in build["notes"], build["notes"]
    assert [m["phase"] for m in rows].count("train_epoch") == 1 and np.isfinite(rows[-1]["accuracy"])


def test_a_region_reads_the_work_of_the_value_it_returns_and_nothing_after(virtual_clock):
    """``timing.timed_region`` itself, with no worker around it: the value comes back fetched, and
    the device work is inside the region whether ``to_host`` or ``sync`` pays it."""
    done_at = virtual_clock() + DEVICE_SECONDS
    value, seconds = timing.timed_region(lambda: lazy_backend.Pending(np.ones(3), done_at),
                                         lambda v: v.result(), lambda: None)
    assert isinstance(value, np.ndarray) and seconds == pytest.approx(DEVICE_SECONDS)

    busy_until = virtual_clock() + DEVICE_SECONDS
    _, seconds = timing.timed_region(lambda: 1.0, None, lambda: virtual_clock.wait_until(busy_until))
    assert seconds == pytest.approx(DEVICE_SECONDS)


#: What ``to_host`` must give for the worker to time and read it: host memory, nothing pending.
HOST = (np.ndarray, np.generic, float, int)


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params(["numpy", "torch", "tensorflow", "jax"]))
def test_each_adapters_to_host_returns_host_values(name):
    """The real adapters that run in this process: ``to_host`` of what ``scores`` and
    ``train_epoch`` return is a NumPy array or scalar, never the framework's (possibly lazy)
    tensor, which the worker would then finish outside the clock."""
    spec = backends.get(name)
    w = workload.load("mnist").with_overrides(limit=64, epochs=1)
    ds = data.load(w, "synthetic")
    x_train, x_test = (data.normalize(x) for x in (ds.x_train, ds.x_test))
    b = spec.load_class()(w, "cpu", spec.modes[0].name)
    b.build(model.initial_weights(w))
    b.set_data(x_train, ds.y_train)
    epoch = [b.to_host(v) for v in b.train_epoch(np.arange(len(ds.y_train)))]
    probs = b.to_host(b.scores(b.to_device(x_test), 32))
    b.sync()
    assert all(isinstance(v, HOST) and np.ndim(v) == 0 for v in epoch), [type(v) for v in epoch]
    assert isinstance(probs, np.ndarray) and probs.shape == (len(x_test), w.num_classes), type(probs)


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params(["tensorflow"]))
def test_tensorflows_sync_waits_for_the_work_in_flight(name):
    """TensorFlow's eager ops may return before they have run (on a GPU, or under an asynchronous
    executor): ``sync`` must wait for them. Patch-free: an op that fails, launched on a throwaway
    asynchronous executor, reports its failure only when something waits for it; a ``sync`` that
    waits raises it, a ``sync`` that does nothing returns quietly."""
    import tensorflow as tf
    from tensorflow.python.eager import context, executor

    spec = backends.get(name)
    b = spec.load_class()(workload.load("mnist").with_overrides(limit=64), "cpu", spec.modes[0].name)
    pending = executor.new_executor(enable_async=True)  # not the process's executor, which stays clean
    with context.executor_scope(pending):
        tf.debugging.check_numerics(tf.constant([np.nan]), "planted in flight")
        try:
            with pytest.raises(tf.errors.InvalidArgumentError, match="planted in flight"):
                b.sync()
        finally:
            pending.clear_error()
