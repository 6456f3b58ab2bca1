"""What ``benchbackend list`` shows: workloads, and backends with availability, version and devices.

Devices come from asking each installed backend's worker (``python -m benchbackend.run.worker --probe``)
in its own process, in parallel, so this process never imports a framework. A probe takes seconds
(the framework's import), so its answer is cached in ``paths.cache_dir() / "devices.json"``, keyed
on what could change it: the interpreter, the adapter, the installed version, this package's
version, the host and the device-selecting environment variables (``CUDA_*``, ``TF_*``, ...). A
new driver or a GPU added under the same key is not seen until ``list --refresh``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .backends import registry as backends
from .errors import BackendUnavailable, WorkloadError
from .spec import model, workload

PROBE_TIMEOUT_S = 120
#: Environment variables (by prefix) that choose what devices a framework sees.
DEVICE_VARS = ("CUDA_", "HIP_", "ROCR_", "TPU_", "JAX_", "XLA_", "TF_", "PLAIDML_", "OCL_", "KERAS_", "PYTHONPATH")


def _cache_path() -> Path:
    from .paths import cache_dir

    return cache_dir() / "devices.json"


def _key(spec: backends.BackendSpec) -> str:
    from . import __version__
    from .run.launch import python_for, worker_environ

    env = {k: v for k, v in sorted(worker_environ(spec).items()) if k.startswith(DEVICE_VARS)}
    parts = [python_for(spec), spec.target, backends.version(spec), __version__, platform.node(), env]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _load() -> dict[str, Any]:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _save(cache: dict[str, Any]) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs the probe again next time


def probes(specs: list[backends.BackendSpec], refresh: bool = False,
           progress: Callable[[str], None] = lambda line: None) -> dict[str, dict[str, Any]]:
    """Each backend's probe (``{"version", "devices"}`` or ``{"error"}``), from the cache where its
    key is unchanged (then with ``"cached"``: the date it was probed), else probed now, in parallel;
    ``progress`` hears which backends are being probed. A failed probe is never cached."""
    cache = {} if refresh else _load()
    keys = {s.name: _key(s) for s in specs}
    out = {s.name: dict(cache[keys[s.name]]) for s in specs if keys[s.name] in cache}
    todo = [s for s in specs if s.name not in out]
    if todo:
        progress(f"probing devices of {', '.join(s.name for s in todo)} (cached afterwards; list --refresh re-probes)")
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {s.name: pool.submit(probe, s) for s in todo}
            fresh = {name: f.result() for name, f in futures.items()}
        stamp = time.strftime("%Y-%m-%d")
        cache = _load()
        for name, found in fresh.items():
            out[name] = found
            if "error" not in found:
                cache[keys[name]] = dict(found, cached=stamp)
        _save(cache)
    return out


def probe(spec: backends.BackendSpec) -> dict[str, Any]:
    """``{"version", "devices"}`` from the backend's own interpreter, or ``{"error": ...}``."""
    from .backends.probe import probe_in
    from .run.launch import python_for, worker_environ

    try:
        return probe_in(python_for(spec), spec.target, worker_environ(spec), PROBE_TIMEOUT_S)
    except BackendUnavailable as exc:
        return {"error": str(exc)}


def render(probe_devices: bool = True, refresh: bool = False,
           progress: Callable[[str], None] = lambda line: None) -> str:
    lines = ["Workloads:"]
    for name, path in workload.available().items():
        try:
            w = workload.load(str(path))
            info = (f"{w.data.dataset:<9} {model.param_count(w):>13,} params  "
                    f"{model.flops_per_sample(w) / 1e6:>11.1f} MFLOPs/sample  {w.training.optimizer} "
                    f"lr {w.training.lr:g}, batch {w.training.batch_size}, {w.training.epochs} epoch"
                    + ("s" if w.training.epochs != 1 else ""))
        except (WorkloadError, ValueError) as exc:
            info = f"INVALID: {exc}"
        lines.append(f"  {name:<12} {info}")
    lines += ["", "Backends:"]
    specs = [backends.get(name) for name in backends.BACKENDS]
    problems = {s.name: backends.problem(s) for s in specs}
    ready = {name: not why for name, why in problems.items()}
    found: dict[str, dict[str, Any]] = {}
    if probe_devices:
        found = probes([s for s in specs if ready[s.name]], refresh, progress)
    for s in specs:
        if not ready[s.name]:
            lines.append(f"  {s.name:<11} not installed ({problems[s.name]})   install: {s.install}")
            continue
        p = found.get(s.name, {})
        if "error" in p:
            devices = f"devices: probe failed: {p['error']}"
        elif p:
            devices = "devices: " + ", ".join(device_name(d) for d in p.get("devices", []))
            devices += f" (probed {p['cached']})" if p.get("cached") else ""
        else:
            devices = "devices: (not probed)"
        lines.append(f"  {s.name:<11} {backends.version(s) or p.get('version', ''):<16} {devices}")
        lines.append(f"  {'':<11} {s.description}{'' if s.trains else ' (inference only)'}")
    lines += ["", "Modes (the first is the default) and precisions:"]
    for s in specs:
        lines.append(f"  {s.name:<11} precisions: {', '.join(s.precisions)}{_data_parallel(s)}")
        for m in s.modes:
            lines.append(f"  {'':<13}{m.name:<16} {m.description}")
    return "\n".join(lines)


def device_name(found: str) -> str:
    """A device as a backend's probe names it, shown as the CSV's ``device`` column names it
    (``results.canonical_device``): TensorFlow's ``CPU:0`` is ``cpu``, its ``GPU:1`` is ``gpu:1``.
    A device with no canonical form (a TPU, an OpenCL id, TVM's target) keeps its own name."""
    from .results import canonical_device

    name = canonical_device(found)
    return name if name == "cpu" or name.startswith("gpu:") else found


def _data_parallel(s: backends.BackendSpec) -> str:
    """Whether ``--replicas N`` trains on the backend's own engine, and across Ray nodes (README "Data parallel")."""
    if not s.trains:
        return ""
    if not s.capabilities.replicas:
        return "; --replicas N: no data-parallel engine"
    return "; --replicas N: yes" + (", across Ray nodes too" if s.capabilities.ray_train else ", on one machine")


def markdown_table() -> str:
    """The README's backend table, from the registry (a test keeps the README in step)."""
    rows = ["| backend | what | trains | modes (first = default) | precisions | install |",
            "| --- | --- | --- | --- | --- | --- |"]
    for s in backends.BACKENDS.values():
        modes = ", ".join(f"`{m.name}`" for m in s.modes)
        rows.append(f"| `{s.name}` | {s.description} | {'yes' if s.trains else 'no'} | {modes} | "
                    f"{', '.join(s.precisions)} | `{s.install}` |")
    return "\n".join(rows)
