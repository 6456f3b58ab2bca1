"""A test-only backend with a known service time (issue 39): the NumPy reference's outputs, each
call taking ``SERVICE_S`` per sample, so a scenario's latencies can be checked against queueing theory.

The network of ``tiny()`` costs microseconds; the sleep is ended by a short spin so that the
service time is ``SERVICE_S`` to well under a percent, not the scheduler's overshoot.
"""
from __future__ import annotations

import time
from typing import Any

from benchbackend.backends.numpy.reference import NumpyBackend
from benchbackend.spec import workload

#: Seconds per sample of every ``scores`` call.
SERVICE_S = 0.004


def hold(seconds: float) -> None:
    """Wait ``seconds``: sleep most of it, spin the last half millisecond."""
    end = time.perf_counter() + seconds
    if seconds > 6e-4:
        time.sleep(seconds - 5e-4)
    while time.perf_counter() < end:
        pass


class SleepingBackend(NumpyBackend):
    service_s = SERVICE_S

    def scores(self, x: Any, batch_size: int) -> Any:
        start = time.perf_counter()
        out = super().scores(x, batch_size)
        hold(self.service_s * len(x) - (time.perf_counter() - start))
        return out


class FastSleepingBackend(SleepingBackend):
    """Half the service time, for the Server tests that need thousands of queries per LoadGen run
    (their time is the query count over the rate); they run alone, where 2 ms sleeps keep their time."""

    service_s = SERVICE_S / 2


class QuickSleepingBackend(SleepingBackend):
    """A quarter of the service time, for the Server peak search (eight LoadGen runs of 2,000 queries:
    28 s instead of 56). Its queue is further from M/D/1's (LoadGen's hand-offs are a larger share of
    1 ms: a Server run's mean read 1.02-1.07 of the theory's against 1.01-1.02 at 2 ms), which the
    search's bound has room for (peaks 0.93-0.99 of the analytic rate) and the M/D/1 test does not."""

    service_s = SERVICE_S / 4


def tiny(test: int = 256) -> workload.Workload:
    """A network of one dense layer on 8 features: its own cost is negligible beside ``SERVICE_S``."""
    return workload.Workload.model_validate({
        "name": "tiny", "seed": 3,
        "data": {"dataset": "synthetic", "input_shape": [8], "num_classes": 4, "train": 64, "validation": 0,
                 "test": test},
        "model": [{"type": "dense", "units": 4, "activation": "softmax"}],
        "training": {"optimizer": "sgd", "lr": 0.01, "loss": "categorical_crossentropy", "batch_size": 32,
                     "epochs": 1},
        "inference": {"batch_size": 32, "repeats": 2}})
