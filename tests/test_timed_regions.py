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
from support.lazy_backend import DEVICE_SECONDS

from benchbackend import backends, data, model, timing, workload
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
