"""Timers and the device-sync contract.

Every clock read happens after the device is synced. Adapters make that true by returning host
values (a loss fetched to the host, a predicted array copied back, ``torch.cuda.synchronize()``
on CUDA) from every call the worker times; ``timed`` only reads the clock around such calls.
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Callable, TypeVar

T = TypeVar("T")
clock = time.perf_counter


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Run ``fn`` (which must return synced, host-side results) and return (result, seconds)."""
    start = clock()
    result = fn()
    return result, clock() - start


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024
