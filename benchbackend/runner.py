"""Plans the matrix (workload x backend x repeat) and runs each cell in a fresh worker process.

Rows are written to the CSV as the worker streams them; a crash, a timeout or Ctrl-C loses
nothing already measured. When a cell ends, the checks give it a final status, which every row
of the cell carries.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from . import backends, checks, data, model, results
from .errors import BackendUnavailable
from .workload import Workload

Progress = Callable[[str], None]
HEARTBEAT_S = 30.0
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


@dataclass
class CellResult:
    workload: str
    backend: str
    device: str
    repeat: int
    status: str = "ok"
    message: str = ""
    epoch_seconds: list[float] = field(default_factory=list)
    val_accuracy: Optional[float] = None
    inference_seconds: list[float] = field(default_factory=list)

    def line(self) -> str:
        steady = self.epoch_seconds[1:] or self.epoch_seconds
        epoch = f"epoch {np.median(steady):.3f}s" if steady else "epoch n/a"
        acc = f"val_acc {self.val_accuracy:.3f}" if self.val_accuracy is not None else "val_acc n/a"
        inf = f"infer {np.median(self.inference_seconds):.3f}s" if self.inference_seconds else "infer n/a"
        head = f"{self.workload:<10} {self.backend:<11} {self.device:<8} r{self.repeat}"
        tail = f"  {self.message}" if self.message and self.status != "ok" else ""
        return f"{head}  {self.status:<16} {epoch}  {acc}  {inf}{tail}"


@dataclass
class RunPlan:
    workloads: list[Workload]
    backends: list[str]
    device: str = "cpu"
    repeats: int = 1
    timeout: Optional[float] = None
    data_source: str = "auto"
    data_dir: Optional[Path] = None
    parity_steps: int = 0
    output: Path = Path("results/run.csv")


def python_for(spec: backends.BackendSpec) -> str:
    if spec.python:
        return spec.python
    if spec.isolated_env:
        from . import envs

        return str(envs.python_for(spec.isolated_env))
    return sys.executable


def worker_environ(spec: backends.BackendSpec) -> dict[str, str]:
    """Environment of a worker: an isolated env must not see the main env's packages."""
    if spec.isolated_env:
        from . import envs

        return envs.worker_env()
    path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def _tail(text: str, lines: int = 6, chars: int = 600) -> str:
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-chars:]


class Runner:
    """Runs a :class:`RunPlan`; ``progress`` receives human-readable lines (the CLI prints them)."""

    def __init__(self, plan: RunPlan, progress: Progress = lambda s: None):
        self.plan = plan
        self.progress = progress
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.env = results.environment()
        self.writer = results.CsvWriter(plan.output)
        self.cells: list[CellResult] = []

    # --- rows -------------------------------------------------------------------------------
    def _base(self, w: Workload, backend: str, repeat: int, info: dict[str, Any]) -> dict[str, Any]:
        return {"run_id": self.run_id, "workload": w.name, "workload_hash": w.hash(), "backend": backend,
                "backend_version": info.get("backend_version", ""), "device": info.get("device", self.plan.device),
                "mode": info.get("mode", ""), "repeat": repeat, "host": self.env["host"], "os": self.env["os"],
                "python": info.get("python", self.env["python"]), "cpu": self.env["cpu"], "gpu": info.get("gpu", ""),
                "flops_per_sample": model.flops_per_sample(w), "params": model.param_count(w),
                "requested_device": self.plan.device}

    def _write(self, base: dict[str, Any], row: dict[str, Any], status: str = "ok") -> dict[str, Any]:
        full = {**base, **{k: v for k, v in row.items() if k != "type"}}
        full.setdefault("status", status)
        full["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.writer.write(full)
        return full

    def _status_row(self, base: dict[str, Any], status: str, message: str) -> None:
        self._write(base, {"phase": "run", "epoch": 0, "status": status, "message": message})

    # --- matrix -----------------------------------------------------------------------------
    def run(self) -> list[CellResult]:
        with tempfile.TemporaryDirectory(prefix="benchbackend-") as tmp:
            # All data first: a missing file fails the run before anything is measured.
            prepared = [(w, self._prepare(w, Path(tmp))) for w in self.plan.workloads]
            for w, npz in prepared:
                for name in self.plan.backends:
                    self._run_backend(w, name, npz)
        return self.cells

    def _prepare(self, w: Workload, tmp: Path) -> Path:
        """The run's arrays and per-epoch orders, once per workload: every backend gets these."""
        self.progress(f"[{w.name}] preparing data ({self.plan.data_source})")
        ds = data.load(w, self.plan.data_source, self.plan.data_dir, progress=self._download_progress)
        orders = data.epoch_orders(len(ds.y_train), w.training.epochs, w.seed)
        path = tmp / f"{w.name}-{w.hash()}.npz"
        np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_val=ds.x_val, y_val=ds.y_val,
                 x_test=ds.x_test, y_test=ds.y_test, orders=orders)
        self.progress(f"[{w.name}] {ds.source} data: {len(ds.y_train)} train, {len(ds.y_val)} validation, "
                      f"{len(ds.y_test)} test")
        return path

    def _download_progress(self, name: str, done: int, total: int) -> None:
        if total and (done == total or done % (8 << 20) < 65536):
            self.progress(f"  downloading {name}: {done / total:.0%} of {total / 1e6:.1f} MB")

    def _run_backend(self, w: Workload, name: str, npz: Path) -> None:
        spec = backends.get(name)
        if not backends.installed(spec):
            cell = CellResult(w.name, name, self.plan.device, 1, "unavailable", f"not installed: {spec.install}")
            self._status_row(self._base(w, name, 1, {}), cell.status, cell.message)
            self._report(cell)
            return
        for repeat in range(1, self.plan.repeats + 1):
            cell = self._run_cell(w, spec, repeat, npz)
            self._report(cell)
            if cell.status == "unavailable":
                return  # the other repeats would say the same

    def _report(self, cell: CellResult) -> None:
        self.cells.append(cell)
        if cell.status != "ok":
            self.progress(f"[{cell.workload}/{cell.backend} r{cell.repeat}] {cell.status}: {cell.message}")

    # --- one cell ---------------------------------------------------------------------------
    def _run_cell(self, w: Workload, spec: backends.BackendSpec, repeat: int, npz: Path) -> CellResult:
        job = {"workload": w.to_dict(), "backend": spec.name, "device": self.plan.device, "repeat": repeat,
               "data": str(npz), "parity_steps": self.plan.parity_steps}
        cell = CellResult(w.name, spec.name, self.plan.device, repeat)
        base = self._base(w, spec.name, repeat, {})
        rows: list[dict[str, Any]] = []
        tag = f"[{w.name}/{spec.name} r{repeat}/{self.plan.repeats}]"
        self.progress(f"{tag} starting worker")
        env = dict(worker_environ(spec), PYTHONUNBUFFERED="1")
        with tempfile.TemporaryFile("w+") as err:
            try:
                proc = subprocess.Popen([python_for(spec), "-m", "benchbackend.worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                        start_new_session=True)
            except OSError as exc:
                cell.status, cell.message = "crashed", f"cannot start worker: {exc}"
                self._status_row(base, cell.status, cell.message)
                return cell
            assert proc.stdin and proc.stdout
            try:
                proc.stdin.write(json.dumps(job))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the worker died before reading its job: its exit code and stderr say why
            lines: "queue.Queue[Optional[str]]" = queue.Queue()
            threading.Thread(target=lambda: ([lines.put(ln) for ln in proc.stdout], lines.put(None)), daemon=True).start()
            ended, error = self._pump(lines, proc, w, base, rows, cell, tag)
            if cell.status == "unavailable":
                self._status_row(base, cell.status, cell.message)
                return cell
            if not ended:  # timeout
                cell.status = "timeout"
                err.seek(0)
                stderr = _tail(err.read())
                cell.message = f"worker ran past --timeout {self.plan.timeout:g}s" + (f"; stderr: {stderr}" if stderr else "")
            elif error is not None or proc.returncode != 0:
                err.seek(0)
                stderr = _tail(err.read())
                what = error or f"worker exited with code {proc.returncode}"
                cell.status, cell.message = "crashed", what + (f"; stderr: {stderr}" if stderr else "")
        if cell.status in ("timeout", "crashed"):
            self._status_row(base, cell.status, cell.message)
        else:
            cell.status, cell.message = checks.cell_status(rows, w)
        self.writer.set_status({"run_id": self.run_id, "workload": w.name, "backend": spec.name, "repeat": repeat},
                               cell.status)
        return cell

    def _pump(self, lines: "queue.Queue[Optional[str]]", proc: subprocess.Popen, w: Workload,
              base: dict[str, Any], rows: list[dict[str, Any]], cell: CellResult, tag: str) -> tuple[bool, Optional[str]]:
        """Read worker messages until it exits. Returns (ended in time, error message or None)."""
        start = time.monotonic()
        error: Optional[str] = None
        try:
            while True:
                remaining = None if self.plan.timeout is None else self.plan.timeout - (time.monotonic() - start)
                if remaining is not None and remaining <= 0:
                    self._kill(proc)
                    return False, None
                try:
                    line = lines.get(timeout=min(HEARTBEAT_S, remaining) if remaining is not None else HEARTBEAT_S)
                except queue.Empty:
                    self.progress(f"{tag} still running ({time.monotonic() - start:.0f}s)")
                    continue
                if line is None:
                    proc.wait()
                    return True, error
                error = self._handle(line, w, base, rows, cell, tag) or error
        except KeyboardInterrupt:
            self._kill(proc)
            cell.status, cell.message = "crashed", "interrupted (Ctrl-C)"
            self._status_row(base, cell.status, cell.message)
            self.writer.set_status({"run_id": self.run_id, "workload": w.name, "backend": cell.backend,
                                    "repeat": cell.repeat}, cell.status)
            raise

    def _handle(self, line: str, w: Workload, base: dict[str, Any], rows: list[dict[str, Any]], cell: CellResult,
                tag: str) -> Optional[str]:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return None  # not protocol output; the worker keeps stdout clean, so ignore strays
        kind = msg.get("type")
        if kind == "info":
            base.update(self._base(w, cell.backend, cell.repeat, msg))
            cell.device = base["device"]
            self.progress(f"{tag} {cell.backend} {msg.get('backend_version')} on {cell.device} ({msg.get('mode')})")
        elif kind == "row":
            status = "nan_loss" if msg.get("phase") == "train_epoch" and not checks.finite(msg.get("loss")) else "ok"
            rows.append(self._write(base, msg, status))
            self._progress_row(msg, w, cell, tag)
        elif kind == "unavailable":
            cell.status, cell.message = "unavailable", msg.get("message", "")
        elif kind == "error":
            tb = _tail(msg.get("traceback", ""), lines=3)
            return f"{msg.get('message', 'error')} ({tb})" if tb else msg.get("message", "error")
        return None

    def _progress_row(self, msg: dict[str, Any], w: Workload, cell: CellResult, tag: str) -> None:
        phase = msg.get("phase")
        if phase == "train_epoch":
            cell.epoch_seconds.append(msg["seconds"])
            cell.val_accuracy = msg.get("val_accuracy")
            self.progress(f"{tag} epoch {msg['epoch']}/{w.training.epochs}  loss {msg['loss']:.4f}  "
                          f"acc {msg['accuracy']:.3f}  val_acc {msg['val_accuracy']:.3f}  {msg['seconds']:.2f}s  "
                          f"{msg.get('samples_per_s') or 0:.0f} samples/s")
        elif phase == "build":
            self.progress(f"{tag} built {msg.get('params')} params in {msg['seconds']:.2f}s")
        elif phase == "parity" and msg.get("parity_max_rel") is not None:
            self.progress(f"{tag} parity vs NumPy reference: max abs {msg['parity_max_abs']:.2g}, "
                          f"max rel {msg['parity_max_rel']:.2g}")
        elif phase == "parity":
            self.progress(f"{tag} trajectory: {msg.get('message')}")
        elif phase == "inference":
            cell.inference_seconds.append(msg["seconds"])
            if msg["epoch"] == w.inference.repeats:
                self.progress(f"{tag} inference x{msg['epoch']}: median {np.median(cell.inference_seconds):.3f}s")

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def check_backends(names: list[str]) -> None:
    """Raise for unknown names, and when none of the requested backends is installed."""
    specs = [backends.get(n) for n in names]
    problems = []
    for spec in specs:
        try:
            backends.require(spec)
        except BackendUnavailable as exc:
            problems.append(str(exc))
    if len(problems) == len(specs):
        raise BackendUnavailable("; ".join(problems))
