"""XLA's CPU thread pool: one per process, shared by its CPU devices, sized when the backend starts.

XLA's CPU client sizes it from ``PJRT_NPROC``, else every schedulable core; the OpenMP and MKL
variables that ``--threads`` sets, it ignores (a ``--threads 1`` cell ran on every core:
``benchmarks/knobs.py``, ``jax.threads``). So ``--threads`` is applied here, before the backend
starts, and the ``threads`` column reads the pool back.
"""
from __future__ import annotations

import os
from typing import Optional


def size_pool(threads: Optional[int], replicas: int = 1) -> None:
    """Size the pool for ``threads`` per replica (the runner's split; jax's replicas share the one
    pool). Takes effect only before the process's JAX backend starts (the worker's first device query)."""
    if threads:
        os.environ["PJRT_NPROC"] = str(threads * replicas)


def pool_threads() -> int:
    """Threads of the pool as XLA sizes it: ``PJRT_NPROC``, else the schedulable cores."""
    nproc = os.environ.get("PJRT_NPROC", "")
    return int(nproc) if nproc.isdigit() else len(os.sched_getaffinity(0))
