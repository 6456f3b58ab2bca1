"""Backends registered only by the tests: the NumPy reference on a simulated asynchronous device.

``LazyNumpyBackend``: every call that "launches device work" (``scores``, ``train_epoch``) returns
at once with its result, but the simulated device stays busy for ``LAZY_DELAY`` seconds (env var)
afterwards; only ``sync`` waits for it, as ``torch.cuda.synchronize`` or JAX's
``block_until_ready`` would. ``to_host`` does not wait (a non-blocking copy). A harness that reads
the clock without the backend's sync therefore under-measures by the delay (real time: it runs
through ``benchbackend run`` in a worker process).

``SyncDevice`` and ``ToHostDevice``: the same on a virtual clock (``CLOCK``), the device work paid
in ``sync`` or in ``to_host``, for exact tests of what a timed region includes (see below).

``PlacingDevice``: copies to the device queued with the work, for tests of where the one-off copy
of the run's arrays is timed (the ``build`` row, never an epoch or a pass).

``CompilingDevice``: ``SyncDevice`` whose first step at each shape compiles (``compile_s``).

``LowPeakNumpyBackend``: a GEMM probe that reads far too low. ``CpuZeroNumpyBackend``: the host CPU
named as TensorFlow names it.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from benchbackend.backends.numpy.reference import NumpyBackend


class LazyNumpyBackend(NumpyBackend):
    name = "lazy"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delay = float(os.environ.get("LAZY_DELAY", "0.25"))
        self.busy_until = 0.0

    def _launch(self) -> None:
        self.busy_until = time.perf_counter() + self.delay

    def scores(self, x: Any, batch_size: int) -> Any:
        out = super().scores(x, batch_size)
        self._launch()
        return out

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        out = super().train_epoch(order)
        self._launch()
        return out

    def sync(self) -> None:
        wait = self.busy_until - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class LowPeakNumpyBackend(NumpyBackend):
    """The reference with a GEMM probe that reads far too low, as one taken under heavy load
    would: every MFU computed from it is above 100%. ``LOW_PEAK_CALLS`` (a file) counts probes."""

    name = "lowpeak"

    def gemm_peak(self, precision: str) -> float:
        calls = os.environ.get("LOW_PEAK_CALLS")
        if calls:
            with open(calls, "a") as f:
                f.write(precision + "\n")
        return 1e3  # 1 kFLOP/s


# --- a simulated device on a virtual clock -------------------------------------------------------
# The tests of the worker's timed regions replace ``timing.clock`` with ``CLOCK``: only the simulated
# device's work advances it, so a region reads exactly the device seconds it waited for and none of
# the host's own compute. What a region includes is then decided exactly, not by how loaded the
# machine is (a real-clock test with a 0.4 s delay cannot tell a missing wait from a slow host).
class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


CLOCK = VirtualClock()
#: Virtual seconds of device work behind every ``scores`` and ``train_epoch`` call.
DEVICE_SECONDS = 0.5


class SyncDevice(NumpyBackend):
    """Results come back at once as host arrays, but the device stays busy ``DEVICE_SECONDS`` after
    each call: only ``sync`` waits for it (a CUDA stream; ``to_host`` a non-blocking copy)."""

    name = "lazy-sync"
    busy_until = 0.0

    def scores(self, x: Any, batch_size: int) -> Any:
        out = super().scores(x, batch_size)
        self.busy_until = CLOCK() + DEVICE_SECONDS
        return out

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        out = super().train_epoch(order)
        self.busy_until = CLOCK() + DEVICE_SECONDS
        return out

    def sync(self) -> None:
        CLOCK.wait_until(self.busy_until)


class Pending:
    """A value the simulated device is still computing (``done_at`` on ``CLOCK``). The first look at
    it waits: ``to_host``, or a NumPy or float conversion, as a framework's lazy tensor allows."""

    def __init__(self, value: Any, done_at: float):
        self.value, self.done_at = value, done_at

    def result(self) -> Any:
        CLOCK.wait_until(self.done_at)
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.result(), dtype)

    def __float__(self) -> float:
        return float(self.result())


class ToHostDevice(NumpyBackend):
    """Lazy results (JAX, TensorFlow's async eager): ``scores`` and ``train_epoch`` return
    ``Pending`` values, and the ``DEVICE_SECONDS`` of work are paid when ``to_host`` fetches them;
    ``sync`` has nothing left to wait for."""

    name = "lazy-to-host"

    def scores(self, x: Any, batch_size: int) -> Any:
        return Pending(super().scores(x, batch_size), CLOCK() + DEVICE_SECONDS)

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        done_at = CLOCK() + DEVICE_SECONDS
        return tuple(Pending(v, done_at) for v in super().train_epoch(order))

    def to_host(self, value: Any) -> Any:
        return super().to_host(value.result() if isinstance(value, Pending) else value)


#: Virtual seconds of every copy to the simulated device (``set_data`` and each ``to_device``).
COPY_SECONDS = 0.125


class PlacingDevice(NumpyBackend):
    """One in-order queue of device work on ``CLOCK`` (a CUDA stream): each copy to the device
    (``set_data``, ``to_device``) takes ``COPY_SECONDS`` and each ``scores``/``train_epoch``
    ``DEVICE_SECONDS``; calls return at once, and ``sync`` or fetching a result (``to_host``, a
    blocking copy) waits for everything queued. A region then reads exactly the work it queued
    plus what was still queued when it began: a copy made before the clock but not waited for, or
    made inside it, shows in that epoch or pass; one the build region does not wait for, nowhere."""

    name = "placing"
    busy_until = 0.0

    def _queue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, CLOCK()) + seconds

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        super().set_data(x_train, y_train)
        self._queue(COPY_SECONDS)

    def to_device(self, x: np.ndarray) -> Any:
        self._queue(COPY_SECONDS)
        return super().to_device(x)

    def scores(self, x: Any, batch_size: int) -> Any:
        self._queue(DEVICE_SECONDS)
        return super().scores(x, batch_size)

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        self._queue(DEVICE_SECONDS)
        return super().train_epoch(order)

    def sync(self) -> None:
        CLOCK.wait_until(self.busy_until)

    def to_host(self, value: Any) -> Any:
        CLOCK.wait_until(self.busy_until)
        return super().to_host(value)


#: Virtual seconds a ``CompilingDevice`` spends compiling a step the first time it meets its shape.
COMPILE_SECONDS = 2.0


class CompilingDevice(SyncDevice):
    """``SyncDevice`` with a shape-specialized JIT: the first training step, and the first forward
    at each batch size, cost ``COMPILE_SECONDS`` more (the parity and validation passes run at
    another batch size than the timed inference passes, as in the worker)."""

    name = "compiling"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.compiled: set[Any] = set()

    def _compile(self, shape: Any) -> None:
        if shape not in self.compiled:
            self.compiled.add(shape)
            self.busy_until += COMPILE_SECONDS

    def scores(self, x: Any, batch_size: int) -> Any:
        out = super().scores(x, batch_size)
        self._compile(("forward", batch_size))
        return out

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        out = super().train_epoch(order)
        self._compile("train")
        return out


class CpuZeroNumpyBackend(NumpyBackend):
    """The reference naming the host CPU as TensorFlow does (``cpu:0``), with a GEMM probe of its own."""

    name = "cpuzero"

    def device_id(self) -> str:
        return "cpu:0"

    def gemm_peak(self, precision: str) -> float:
        return 1e9  # below any real CPU's: the entry's best stays NumPy's
