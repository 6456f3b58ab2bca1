"""MFU and the GEMM-peak cache behind it: one denominator per device and precision.

``utilization`` turns a timed row's throughput into achieved FLOP/s and MFU (a training sample
costs ``results.TRAIN_FLOPS_FACTOR`` forward passes).

MFU must compare across backends, so its denominator is not each framework's own GEMM probe (on a
2-core CPU torch's read 0.194 and TensorFlow's 0.223 TFLOP/s: the same work would show two MFUs).
It is the best probe taken on the device, in the precision, with the threads: one cache entry per
(host, device model, device, precision, threads) holds every probe taken there, one per prober (a
backend's own framework, or NumPy's for a CPU cell of a backend without one), and the cell's
peak is the best of them. The datasheet figure given with ``--peak-tflops`` is a second
denominator (``mfu_datasheet``), never a replacement. A run whose backends probe for the first
time can still see the best rise between its cells, so the file's final rewrite
(``results.finalize``) gives every timed row the best peak the file holds per device and
precision, as ``compare``, the report and the plots do (``analysis.rates.one_peak``): one rule,
``results.best_peaks`` and ``results.mfu_values``.

A probe taken while something else loaded the machine reads low, and every MFU computed from it
reads high (so does a framework's probe that takes a slow path: torch's bf16 GEMM on a CPU without
bf16 instructions read 1.33 GFLOP/s where TensorFlow's read 56.5). An MFU above 1 is never
written: the row's is left out and ``mfu_missing`` says why, and the entry is dropped
(:func:`forget`), so that the next cell on the device probes again; a new probe never lowers a
stored one.
The file is ``paths.cache_dir() / "peaks.json"``: deleting it re-measures everything.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from .. import results


def path() -> Path:
    from ..paths import cache_dir

    return cache_dir() / "peaks.json"


def key(host: str, model: str, device: str, precision: str, threads: Optional[int]) -> str:
    """The cache key of a device: ``device`` as ``results.canonical_device`` names it (``cpu``,
    ``gpu:0``: one entry whichever framework probed it); ``model`` is the GPU's name or the CPU's
    (two hosts may share a name, not a model); a peak measured with 1 thread is not the peak of 2."""
    return "|".join([host, model, device, precision, f"threads={threads or 'all'}"])


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


def _probes(entry: Any) -> dict[str, tuple[float, str]]:
    """The probes of one cache entry: {prober: (FLOP/s, date measured)}."""
    found = entry.get("probes") if isinstance(entry, dict) else None
    out: dict[str, tuple[float, str]] = {}
    for prober, probe in (found.items() if isinstance(found, dict) else ()):
        try:
            out[str(prober)] = float(probe["flops"]), str(probe["when"])
        except (TypeError, KeyError, ValueError):
            continue  # one damaged probe costs that probe again, not the others
    return out


def probes(k: str) -> dict[str, tuple[float, str]]:
    """Every probe stored for device key ``k``: {prober: (FLOP/s, date measured)}."""
    return _probes(_load().get(k))


def best(k: str) -> Optional[tuple[float, str, str]]:
    """(FLOP/s, prober, date) of the best probe on device key ``k``, or None."""
    found = probes(k)
    if not found:
        return None
    prober = max(found, key=lambda p: found[p][0])
    return found[prober][0], prober, found[prober][1]


def store(k: str, prober: str, flops: float) -> float:
    """Keep the better of ``flops`` and ``prober``'s stored value (a peak is a maximum); returns the kept one."""
    cache = _load()
    kept = _probes(cache.get(k))
    stored = kept.get(prober)
    if stored is not None and stored[0] >= flops:
        return stored[0]
    kept[prober] = (flops, time.strftime("%Y-%m-%d"))
    cache[k] = {"probes": {p: {"flops": f, "when": w} for p, (f, w) in kept.items()}}
    _save(cache)
    return flops


def forget(k: str) -> bool:
    """Drop a device's probes, shown to be too low; True when there were any."""
    cache = _load()
    if cache.pop(k, None) is None:
        return False
    _save(cache)
    return True


def sharers(device: str) -> float:
    """Other processes on GPU ``device`` (``gpu:N``) now, by NVML; 0 on a CPU or where NVML cannot
    tell. A GEMM probe taken beside them reads low (on the H100 of issue 42, torch's fp32 probe read
    23 TFLOP/s while three other runs shared the GPU, 52 alone), and a low peak is never replaced
    by a better one unless a row shows MFU above 100%: such a probe serves its cell, uncached."""
    kind, _, index = device.partition(":")
    if kind != "gpu":
        return 0.0
    from .machine import gpu_readings

    return gpu_readings(int(index or 0)).get("gpu_other_procs") or 0.0


def numpy_gemm_peak(precision: str) -> Optional[float]:
    """NumPy's own GEMM probe on this CPU, for the cells of a backend without a probe of its own
    (ONNX Runtime, OpenVINO, TVM, the reference, Keras 3, Chainer, PlaidML): float32 or float64,
    None for a precision NumPy only emulates (its float16 matmul says nothing of a runtime's)."""
    import numpy as np

    from ..backends.base import gemm_rate

    dtype = {"fp32": np.float32, "fp64": np.float64}.get(precision)
    if dtype is None:
        return None
    rng = np.random.default_rng(0)

    def make(n: int, reps: int) -> Any:
        a, b = (rng.random((n, n)).astype(dtype) for _ in range(2))

        def run() -> None:
            for _ in range(reps):
                a @ b
        return run

    return gemm_rate(make, cpu=True)


def achieved(phase: Optional[str], samples_per_s: Optional[float], flops_per_sample: int) -> Optional[float]:
    """The FLOP/s a timed row achieved (a ``train_epoch`` or ``inference`` row with a throughput;
    None for any other): its MFU is ``results.mfu_values``'."""
    if phase not in ("train_epoch", "inference") or not samples_per_s:
        return None
    passes = results.TRAIN_FLOPS_FACTOR if phase == "train_epoch" else 1
    return passes * flops_per_sample * samples_per_s


def too_low(mfu: float, source: str, dropped: bool) -> str:
    """What the run says of a row above 100% MFU: the probe it was measured against is wrong (taken
    under load, a framework's slow path for the precision), and whether the cached probe was dropped,
    so that the next cell on the device probes again (the file's final rewrite divides by the best)."""
    return (f"MFU {mfu:.0%} is above 100%: the peak ({source}) is too low; the row's MFU is left out"
            + ("; the cached probe is dropped, the next cell on this device probes again" if dropped else ""))
