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
