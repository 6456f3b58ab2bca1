"""What ``benchbackend list`` shows: workloads, and backends with availability, version and devices.

Devices come from asking each installed backend's worker (``python -m benchbackend.worker --probe``)
in its own process, in parallel, so this process never imports a framework.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import backends, model, workload
from .errors import BackendUnavailable, WorkloadError

PROBE_TIMEOUT_S = 120


def probe(spec: backends.BackendSpec) -> dict[str, Any]:
    """``{"version", "devices"}`` from the backend's own interpreter, or ``{"error": ...}``."""
    from .launch import python_for, worker_environ
    from .probe import probe_in

    try:
        return probe_in(python_for(spec), spec.target, worker_environ(spec), PROBE_TIMEOUT_S)
    except BackendUnavailable as exc:
        return {"error": str(exc)}


def render(probe_devices: bool = True) -> str:
    lines = ["Workloads:"]
    for name, path in workload.available().items():
        try:
            w = workload.load(str(path))
            info = (f"{w.data.dataset:<8} {model.param_count(w):>10,} params  "
                    f"{model.flops_per_sample(w) / 1e6:>8.1f} MFLOPs/sample  {w.training.optimizer} "
                    f"lr {w.training.lr:g}, batch {w.training.batch_size}, {w.training.epochs} epochs")
        except (WorkloadError, ValueError) as exc:
            info = f"INVALID: {exc}"
        lines.append(f"  {name:<12} {info}")
    lines += ["", "Backends:"]
    specs = [backends.get(name) for name in backends.BACKENDS]
    problems = {s.name: backends.problem(s) for s in specs}
    ready = {name: not why for name, why in problems.items()}
    probes: dict[str, dict[str, Any]] = {}
    if probe_devices:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {s.name: pool.submit(probe, s) for s in specs if ready[s.name]}
            probes = {name: f.result() for name, f in futures.items()}
    for s in specs:
        if not ready[s.name]:
            lines.append(f"  {s.name:<11} not installed ({problems[s.name]})   install: {s.install}")
            continue
        p = probes.get(s.name, {})
        if "error" in p:
            devices = f"devices: probe failed: {p['error']}"
        elif p:
            devices = "devices: " + ", ".join(p.get("devices", []))
        else:
            devices = "devices: (not probed)"
        lines.append(f"  {s.name:<11} {backends.version(s) or p.get('version', ''):<16} {devices}")
        lines.append(f"  {'':<11} {s.description}{'' if s.trains else ' (inference only)'}")
    lines += ["", "Modes (the first is the default) and precisions:"]
    for s in specs:
        lines.append(f"  {s.name:<11} precisions: {', '.join(s.precisions)}")
        for m in s.modes:
            lines.append(f"  {'':<13}{m.name:<16} {m.description}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's backend table, from the registry (a test keeps the README in step)."""
    rows = ["| backend | what | trains | modes (first = default) | precisions | install |",
            "| --- | --- | --- | --- | --- | --- |"]
    for s in backends.BACKENDS.values():
        modes = ", ".join(f"`{m.name}`" for m in s.modes)
        rows.append(f"| `{s.name}` | {s.description} | {'yes' if s.trains else 'no'} | {modes} | "
                    f"{', '.join(s.precisions)} | `{s.install}` |")
    return "\n".join(rows)
