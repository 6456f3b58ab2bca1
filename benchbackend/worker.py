"""One (workload, backend, repeat) cell, inside the backend's own interpreter.

``python -m benchbackend.worker`` reads a JSON job on stdin and writes one JSON line per message
on stdout (the protocol); anything the framework prints goes to stderr. Messages:

- ``{"type": "info", ...}``     backend version, device, mode, gpu, python, params
- ``{"type": "row", ...}``      one measurement (phase build / parity / train_epoch / inference)
- ``{"type": "unavailable", "message"}``  the backend or device is not there
- ``{"type": "error", "message", "traceback"}``  the cell failed
- ``{"type": "done"}``

``python -m benchbackend.worker --probe NAME`` prints ``{"version", "devices"}`` for ``list``.

The order inside a cell: set env vars, import the adapter, load data, build + load the shared
initial weights (timed), parity on a fixed batch against the NumPy float64 reference, optional
trajectory check, then timed epochs (each followed by an untimed validation pass) and timed
inference passes. A NaN/inf training loss stops training (the rows are kept).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import traceback
from typing import Any, Callable

import numpy as np

Emit = Callable[[dict[str, Any]], None]


def _backend_class(name: str, device: str):
    from .backends import get

    spec = get(name)
    for key, value in spec.env(device).items():
        os.environ.setdefault(key, value)
    return spec.load_class()


def _load_arrays(path: str) -> dict[str, np.ndarray]:
    from .data import normalize

    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for k in ("x_train", "x_val", "x_test"):
        arrays[k] = normalize(arrays[k])
    return arrays


def _parity(backend: Any, workload: Any, weights: list[np.ndarray], arrays: dict[str, np.ndarray],
            steps: int, emit: Emit, base: dict[str, Any]) -> None:
    from .backends import reference
    from .checks import parity_errors

    pool = arrays["x_val"] if len(arrays["x_val"]) else arrays["x_train"]
    rng = np.random.default_rng([workload.seed, 7])
    idx = np.sort(rng.choice(len(pool), size=min(workload.checks.parity_batch, len(pool)), replace=False))
    x = pool[idx]
    ref = reference.forward(workload, weights, x.astype(np.float64), dtype=np.float64)
    out = backend.forward(x)
    max_abs, max_rel = parity_errors(out, ref)
    emit({**base, "phase": "parity", "epoch": 0, "samples": len(x), "parity_max_abs": max_abs,
          "parity_max_rel": max_rel})
    if steps <= 0:
        return
    bs = workload.training.batch_size
    order = arrays["orders"][0]
    batch_list = [(arrays["x_train"][order[i * bs:(i + 1) * bs]], arrays["y_train"][order[i * bs:(i + 1) * bs]])
                  for i in range(steps) if i * bs < len(order)]
    ref_losses = reference.train_losses(workload, weights, batch_list, dtype=np.float64)
    losses = backend.train_steps(batch_list)
    rtol = max(workload.checks.parity_rtol * 10, 1e-3)  # losses accumulate float32 error step by step
    diverged = next((i + 1 for i, (a, b) in enumerate(zip(losses, ref_losses))
                     if not np.isfinite(a) or abs(a - b) > rtol * max(abs(b), 1e-12)), None)
    errs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    msg = ("" if diverged is None else
           f"training loss diverges from the reference at step {diverged}: "
           f"{losses[diverged - 1]:.6g} vs {ref_losses[diverged - 1]:.6g}")
    emit({**base, "phase": "parity", "epoch": len(losses), "steps": len(losses), "parity_step": diverged,
          "parity_max_abs": max(errs) if errs else None, "message": msg or f"{len(losses)} steps agree"})


def run_job(job: dict[str, Any], emit: Emit) -> None:
    """Run one cell and stream its messages through ``emit`` (also usable in-process by tests)."""
    from .backends.base import accuracy
    from .errors import BackendUnavailable
    from .model import initial_weights, param_count
    from .timing import peak_rss_mb, timed
    from .workload import Workload

    workload = Workload.model_validate(job["workload"])
    device = job.get("device", "cpu")
    try:
        cls = _backend_class(job["backend"], device)
        backend = cls(workload, device)
    except (BackendUnavailable, ImportError) as exc:
        emit({"type": "unavailable", "message": str(exc).splitlines()[0] if str(exc) else repr(exc)})
        return
    arrays = _load_arrays(job["data"])
    weights = initial_weights(workload, job.get("repeat", 0))
    base: dict[str, Any] = {"type": "row"}
    emit({"type": "info", "backend_version": backend.version(), "device": backend.device_id(),
          "mode": backend.mode, "gpu": backend.gpu_name(), "python": platform.python_version()})

    params, seconds = timed(lambda: backend.build(weights))
    expected = param_count(workload)
    if params != expected:
        raise RuntimeError(f"{job['backend']} built {params} parameters; the spec has {expected}")
    backend.set_data(arrays["x_train"], arrays["y_train"], arrays["x_val"], arrays["y_val"],
                     arrays["x_test"], arrays["y_test"])
    emit({**base, "phase": "build", "epoch": 0, "seconds": seconds, "params": params,
          "peak_rss_mb": peak_rss_mb()})

    _parity(backend, workload, weights, arrays, int(job.get("parity_steps") or 0), emit, base)
    if job.get("parity_steps"):
        backend.build(weights)  # the trajectory check trained a few steps: start over from the shared weights

    n_train = len(arrays["y_train"])
    val_split = "val" if len(arrays["y_val"]) else "test"
    n_val = len(arrays["y_val"]) if val_split == "val" else len(arrays["y_test"])
    steps = -(-n_train // workload.training.batch_size)
    for epoch, order in enumerate(arrays["orders"][: workload.training.epochs], start=1):
        (loss, acc), seconds = timed(lambda: backend.train_epoch(order))
        finite = bool(np.isfinite(loss))
        val_loss, val_acc = backend.evaluate(val_split) if finite else (float("nan"), float("nan"))
        emit({**base, "phase": "train_epoch", "epoch": epoch, "samples": n_train, "seconds": seconds,
              "samples_per_s": n_train / seconds if seconds > 0 else None, "loss": loss, "accuracy": acc,
              "val_loss": val_loss, "val_accuracy": val_acc, "val_samples": n_val, "steps": steps,
              "peak_rss_mb": peak_rss_mb()})
        if not finite:
            return  # nan_loss: stop this repeat's training; its rows are kept

    n_test = len(arrays["y_test"])
    for i in range(1, workload.inference.repeats + 1):
        scores, seconds = timed(backend.predict)
        emit({**base, "phase": "inference", "epoch": i, "samples": n_test, "seconds": seconds,
              "samples_per_s": n_test / seconds if seconds > 0 else None,
              "accuracy": accuracy(np.asarray(scores), arrays["y_test"]), "peak_rss_mb": peak_rss_mb()})


def probe_in(python: str, backend: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``python -m benchbackend.worker --probe BACKEND``: ``{"version", "devices"}``.

    Raises ``BackendUnavailable`` with one line saying why (the worker's own error, the last
    stderr line, or the exit status) when the probe cannot run or fails.
    """
    import subprocess

    from .errors import BackendUnavailable

    try:
        proc = subprocess.run([python, "-m", "benchbackend.worker", "--probe", backend], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailable(f"could not run: {str(exc).splitlines()[0]}") from None
    error = ""
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if proc.returncode == 0 and "devices" in msg:
            return msg
        error = msg.get("message", "") or error
    stderr = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    raise BackendUnavailable(error or (stderr[-1].strip() if stderr else f"exit status {proc.returncode}"))


def _probe(name: str) -> dict[str, Any]:
    cls = _backend_class(name, "gpu")
    return cls.probe()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Keep the protocol channel clean: the original stdout is ours; fd 1 now goes to stderr so
    # framework banners and prints cannot corrupt it.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg, default=float) + "\n")
        proto.flush()

    try:
        if argv[:1] == ["--probe"]:
            emit(_probe(argv[1]))
            return 0
        job = json.loads(sys.stdin.read())
        run_job(job, emit)
        emit({"type": "done"})
        return 0
    except Exception as exc:  # the parent turns this into a `crashed` row with the traceback tail
        lines = str(exc).strip().splitlines()
        emit({"type": "error", "message": f"{type(exc).__name__}: {lines[0] if lines else ''}",
              "traceback": traceback.format_exc()})
        return 1


if __name__ == "__main__":
    sys.exit(main())
