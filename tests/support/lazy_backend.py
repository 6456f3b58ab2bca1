"""A backend registered only by the tests: the NumPy reference on a simulated asynchronous device.

Every call that "launches device work" (``scores``, ``train_epoch``) returns at once with its
result, but the simulated device stays busy for ``LAZY_DELAY`` seconds (env var) afterwards; only
``sync`` waits for it, as ``torch.cuda.synchronize`` or JAX's ``block_until_ready`` would.
``to_host`` does not wait (a non-blocking copy). A harness that reads the clock without the
backend's sync therefore under-measures by the delay.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from benchbackend.backends.reference import NumpyBackend


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
