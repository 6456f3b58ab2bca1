"""The GEMM-peak cache behind MFU: one probe per host, CPU, backend, device, precision and threads.

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
