"""MFU and the GEMM-peak cache behind it: one probe per host, CPU, backend, device, precision and threads.

``utilization`` turns a timed row's throughput into achieved FLOP/s and MFU (a training sample
costs ``TRAIN_FLOPS_FACTOR`` forward passes).

A probe taken while something else loaded the machine reads low, and every MFU computed from it
reads high. So an entry that a run shows to be too low (a timed row above 100% MFU) is dropped
(:func:`forget`), and the next run probes again; a new probe never lowers a stored one.
The file is ``paths.cache_dir() / "peaks.json"``: deleting it re-measures everything.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional


def path() -> Path:
    from .paths import cache_dir

    return cache_dir() / "peaks.json"


def key(host: str, cpu: str, backend: str, device: str, precision: str, threads: Optional[int]) -> str:
    """The cache key: a peak measured with 1 thread is not the peak of 2."""
    return "|".join([host, cpu, backend, device, precision, f"threads={threads or 'all'}"])


def _load() -> dict[str, Any]:
    try:
        cache = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _save(cache: dict[str, Any]) -> None:
    target = path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, target)
    except OSError:
        pass  # an unwritable cache only costs the probe again next time


def _entry(cache: dict[str, Any], k: str) -> Optional[tuple[float, str]]:
    try:
        return float(cache[k]["flops"]), str(cache[k]["when"])
    except (TypeError, KeyError, ValueError):
        return None


def lookup(k: str) -> Optional[tuple[float, str]]:
    """(FLOP/s, date measured) of a stored probe, or None."""
    return _entry(_load(), k)


def store(k: str, flops: float) -> float:
    """Keep the better of ``flops`` and a stored value (a peak is a maximum); returns the kept one."""
    cache = _load()
    old = _entry(cache, k)
    if old is not None and old[0] >= flops:
        return old[0]
    cache[k] = {"flops": flops, "when": time.strftime("%Y-%m-%d")}
    _save(cache)
    return flops


def forget(k: str) -> bool:
    """Drop an entry shown to be too low; True when there was one."""
    cache = _load()
    if cache.pop(k, None) is None:
        return False
    _save(cache)
    return True


#: A training sample costs this many forward passes of FLOPs: the forward, the gradient of the
#: activations and the gradient of the weights (MFU counts training this way everywhere).
TRAIN_FLOPS_FACTOR = 3


def utilization(phase: Optional[str], samples_per_s: Optional[float], flops_per_sample: int,
                peak: Optional[float]) -> dict[str, Optional[float]]:
    """``achieved_flops`` and ``mfu`` (achieved over ``peak``; None without one) of a timed row:
    a ``train_epoch`` or ``inference`` row with a throughput; ``{}`` for any other row."""
    if phase not in ("train_epoch", "inference") or not samples_per_s:
        return {}
    passes = TRAIN_FLOPS_FACTOR if phase == "train_epoch" else 1
    achieved = passes * flops_per_sample * samples_per_s
    return {"achieved_flops": achieved, "mfu": achieved / peak if peak else None}


def too_low(mfu: float, source: str, dropped: bool) -> str:
    """What a row above 100% MFU says: the peak it was measured against is wrong (a probe taken
    under load, a low ``--peak-tflops``), and whether the cached probe was dropped."""
    return (f"MFU {mfu:.0%} is above 100%: the peak ({source}) is too low"
            + ("; the cached probe is dropped, the next run probes again" if dropped else ""))
