"""The clock and the device-sync contract.

Every clock read happens after the device is idle. The worker, not the adapter, ends each timed
region: it calls the adapter, materializes what came back on the host (``to_host``), calls
``sync()``, and only then reads the clock. An adapter that returns lazy arrays (JAX, a CUDA
stream) is therefore timed to completion whether or not it remembered to wait.
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable, Optional

clock = time.perf_counter


def _materialize(value: Any, to_host: Callable[[Any], Any]) -> Any:
    if isinstance(value, tuple):
        return tuple(to_host(v) for v in value)
    return to_host(value)


def timed_region(fn: Callable[[], Any], to_host: Optional[Callable[[Any], Any]],
                 sync: Callable[[], None]) -> tuple[Any, float]:
    """(result, seconds) of ``fn``: the result brought to the host (each tuple item), the device synced."""
    start = clock()
    value = fn()
    if to_host is not None:
        value = _materialize(value, to_host)
    sync()
    return value, clock() - start


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def process_start() -> Optional[float]:
    """When this process started (epoch seconds; a worker forked from a preloader: the fork, its
    framework imported before), from ``/proc``; None where the OS does not say."""
    import os

    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rpartition(")")[2].split()[19])  # field 22, starttime, after the name
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class FirstDispatch:
    """A cell's compile time apart from its steady speed (issue 40): on the row of its second epoch
    (pass), ``compile_s`` = the first epoch's seconds minus this one's (the two run the same steps,
    so the difference is what the first dispatch cost beyond a steady one: tracing, compilation,
    autotuning, first touches), and, in the cell's first timed phase, ``first_result_s`` = the
    process's start to the end of its first step: the wait before the first epoch began, less the
    harness's own work in it (``exclude``: the GEMM probe, the parity checks), plus that epoch
    less its other ``steps - 1`` steps at the steady speed. Nothing with one epoch (pass)."""

    def __init__(self, started: Optional[float]):
        self.started = started
        self.first: dict[str, tuple[float, float]] = {}
        self.leading = ""
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Seconds of the harness's own work before the first step, which a user's program would not do."""
        self.excluded += seconds

    def see(self, phase: str, index: int, began: float, seconds: float, steps: int) -> dict[str, float]:
        """The columns of the ``index``-th epoch (pass) of ``phase``, begun at ``began`` (epoch seconds)."""
        if index == 1:
            self.first[phase] = (began, seconds)
            self.leading = self.leading or phase
        if index != 2 or phase not in self.first:
            return {}
        began_first, first = self.first[phase]
        out = {"compile_s": first - seconds}
        if phase == self.leading and self.started is not None:
            waited = began_first - self.started - self.excluded
            out["first_result_s"] = waited + first - (steps - 1) / max(steps, 1) * seconds
        return out
