"""Runs a plan: prepares the data, hands the cells to an executor, writes every row as it arrives.

The runner is the sink every executor reports to. A cell's rows are written to the CSV the moment
the worker sends them, with the provisional status ``pending``; when the cell ends, ``checks``
decides its status and every row of the cell is rewritten with it. A crash, a timeout, Ctrl-C
(``interrupted``, only for the cell that was running) or a parent killed outright loses nothing
already measured, and never leaves a partial cell marked ``ok``.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from . import backends, checks, data, model, results
from .launch import Outcome
from .paths import PACKAGE_PARENT
from .plan import Group, RunPlan, groups
from .workload import Workload

Progress = Callable[[str], None]
PENDING = "pending"


@dataclass
class CellResult:
    workload: str
    backend: str
    mode: str
    precision: str
    device: str
    repeat: int
    batch: str = ""  # "b128" in a --batch-size sweep
    status: str = PENDING
    message: str = ""
    epoch_seconds: list[float] = field(default_factory=list)
    val_accuracy: Optional[float] = None
    inference_seconds: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.mode}/{self.precision}"

    def line(self) -> str:
        steady = self.epoch_seconds[1:] or self.epoch_seconds
        epoch = f"epoch {np.median(steady):.3f}s" if steady else "epoch n/a"
        acc = f"val_acc {self.val_accuracy:.3f}" if self.val_accuracy is not None else "val_acc n/a"
        passes = self.inference_seconds[1:] or self.inference_seconds
        inf = f"infer {np.median(passes):.3f}s" if passes else "infer n/a"
        head = f"{(self.workload + ' ' + self.batch).strip():<10} {self.label:<28} {self.device:<8} r{self.repeat}"
        tail = f"  {self.message}" if self.message and self.status != "ok" else ""
        return f"{head}  {self.status:<16} {epoch}  {acc}  {inf}{tail}"


def python_for(spec: backends.BackendSpec) -> str:
    if spec.python:
        return spec.python
    if spec.isolated_env:
        from . import envs

        return str(envs.python_for(spec.isolated_env))
    return sys.executable


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def worker_environ(spec: backends.BackendSpec, device: str = "cpu", threads: Optional[int] = None) -> dict[str, str]:
    """The worker's environment: the backend's variables set unconditionally (a user's exported
    ``KERAS_BACKEND`` cannot pick another framework), thread counts, and a PYTHONPATH that shows
    an isolated env nothing of the main env's packages."""
    if spec.isolated_env:
        from . import envs

        env = envs.worker_env()
    else:
        path = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
    if threads:
        env.update({var: str(threads) for var in THREAD_VARS})
    env.update(spec.env(device))
    return env


def definition(w: Workload, source: str) -> str:
    """What defines the measured work, readably (``workload_hash`` is its digest): compare labels
    groups of one workload by the fields that differ."""
    d, t = w.data, w.training
    target = f" target_acc={w.checks.target_accuracy:g}" if w.checks.target_accuracy is not None else ""
    return (f"train={d.train} val={d.validation} test={d.test} epochs={t.epochs} batch={t.batch_size} "
            f"infer_batch={w.inference.batch_size} seed={w.seed} data={source}{target}")


class Runner:
    """Runs a :class:`RunPlan`; ``progress`` receives human-readable lines (the CLI prints them)."""

    def __init__(self, plan: RunPlan, executor: Any, progress: Progress = lambda s: None):
        self.plan = plan
        self.progress = progress
        self.executor = executor  # runs the groups: executors.local.LocalExecutor, executors.ray.RayExecutor
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.env = results.environment()
        self.writer = results.CsvWriter(plan.output)
        self.cells: list[CellResult] = []
        self.npz: dict[str, Path] = {}
        self.data_source: dict[str, str] = {}

    # --- the matrix -------------------------------------------------------------------------
    def run(self) -> list[CellResult]:
        with tempfile.TemporaryDirectory(prefix="benchbackend-") as tmp:
            # All data first: a missing file fails the run before anything is measured.
            for w in self.plan.workloads:
                self.npz[w.hash()] = self._prepare(w, Path(tmp))
            runnable = []
            for group in groups(self.plan):
                if not self._precheck(group):
                    runnable.append(group)
            self.executor.run(self, runnable)
        return self.cells

    def _precheck(self, group: Group) -> bool:
        """Write an ``unavailable`` cell for a group that cannot run here; True when it did."""
        c = group.choice
        spec = backends.get(c.backend)
        # On a cluster, whether a node has the backend shows in its worker's own `unavailable` row.
        remote = getattr(self.executor, "remote", False)
        problem = c.problem or ("" if remote or backends.installed(spec) else f"not installed: {spec.install}")
        if not problem:
            return False
        cell = self.start(group, 1)
        self.finish(cell, Outcome("unavailable", problem))
        return True

    def _prepare(self, w: Workload, tmp: Path) -> Path:
        """The run's arrays and per-epoch orders, once per workload: every backend gets these."""
        ds = data.load(w, self.plan.data_source, self.plan.data_dir, progress=self._download_progress)
        orders = data.epoch_orders(len(ds.y_train), w.training.epochs, w.seed)
        path = tmp / f"{w.name}-{w.hash()}.npz"
        ds.save(path, orders)
        self.data_source[w.hash()] = ds.source
        self.progress(f"[{w.name}] {ds.source} data: {len(ds.y_train)} train, {len(ds.y_val)} validation, "
                      f"{len(ds.y_test)} test")
        return path

    def _download_progress(self, name: str, done: int, total: int) -> None:
        if total and (done == total or done % (8 << 20) < 65536):
            self.progress(f"  downloading {name}: {done / total:.0%} of {total / 1e6:.1f} MB")

    # --- what executors call ----------------------------------------------------------------
    def job(self, group: Group, repeat: int) -> dict[str, Any]:
        """The JSON job of one repeat; paths in it are the driver's (the Ray executor ships the data)."""
        spec = backends.get(group.choice.backend)
        return {"workload": group.workload.to_dict(), "backend": spec.name, "target": spec.target,
                "mode": group.choice.mode, "precision": group.choice.precision, "device": self.plan.device,
                "repeat": repeat, "data": str(self.npz[group.workload.hash()]),
                "parity_steps": self.plan.parity_steps, "trains": spec.trains and not self.plan.inference_only,
                "options": self.plan.options}

    def launch_args(self, group: Group) -> tuple[str, dict[str, str]]:
        """(interpreter, environment) of this group's workers, on this machine."""
        spec = backends.get(group.choice.backend)
        return python_for(spec), worker_environ(spec, self.plan.device, self.plan.options.get("threads"))

    def start(self, group: Group, repeat: int) -> "CellState":
        c, w = group.choice, group.workload
        sweep = len({x.training.batch_size for x in self.plan.workloads if x.name == w.name}) > 1
        batch = f"b{w.training.batch_size}" if sweep else ""
        cell = CellResult(w.name, c.backend, c.mode, c.precision, self.plan.device, repeat, batch)
        tag = f"[{(cell.workload + ' ' + batch).strip()}/{c.backend}:{c.mode}/{c.precision} r{repeat}/{group.repeats}]"
        base = {"run_id": self.run_id, "workload": w.name, "workload_hash": w.hash(), "backend": c.backend,
                "mode": c.mode, "precision": c.precision, "device": self.plan.device, "repeat": repeat,
                **self.env, "flops_per_sample": model.flops_per_sample(w), "params": model.param_count(w),
                "requested_device": self.plan.device, "data_source": self.data_source.get(w.hash(), ""),
                "inference_only": self.plan.inference_only or not backends.get(c.backend).trains,
                "definition": definition(w, self.data_source.get(w.hash(), ""))}
        return CellState(group, cell, base, tag)

    def message(self, state: "CellState", msg: dict[str, Any]) -> None:
        """One worker message, as it arrives."""
        kind = msg.get("type")
        if kind == "info":
            # mode and precision stay the plan's: they identify the cell's rows
            info = {k: msg[k] for k in ("backend_version", "device", "gpu", "python", "threads", "host", "os", "cpu",
                                        "peak_flops", "peak_source") if msg.get(k) not in (None, "")}
            state.base.update(info)
            state.peak_key = msg.get("peak_key") or state.peak_key
            state.cell.device = state.base["device"]
            if "peak_flops" in msg:
                self.progress(f"{state.tag} peak {msg['peak_flops'] / 1e12:.3g} TFLOP/s ({msg.get('peak_source')})")
            else:
                self.progress(f"{state.tag} {state.cell.backend} {msg.get('backend_version')} on {state.cell.device} "
                              f"({msg.get('mode')}, {msg.get('precision')}, {msg.get('threads')} threads)")
        elif kind == "row":
            row = checks.trajectory(msg, state.group.workload) if msg.get("losses") is not None else msg
            row = {**row, **self._mfu(row, state)}
            if (row.get("mfu") or 0) > 1:
                row = {**row, "message": self._peak_too_low(state, row)}
            state.rows.append(self._write(state, row))
            self._progress_row(row, state)

    def finish(self, state: "CellState", outcome: Outcome) -> CellResult:
        """The cell has ended: decide its status, give it to every row of the cell, report it."""
        cell = state.cell
        if outcome.status == "done":
            cell.status, cell.message = checks.cell_status(state.rows, state.group.workload, cell.precision)
            if cell.status != "ok":  # the CSV says why, not only the terminal
                self._write(state, {"phase": "run", "epoch": 0, "message": cell.message})
        else:
            cell.status, cell.message = outcome.status, outcome.message
            self._write(state, {"phase": "run", "epoch": 0, "message": outcome.message})
        values = {}
        target = state.group.workload.checks.target_accuracy
        if target is not None:
            values["time_to_accuracy_s"] = checks.time_to_accuracy(state.rows, target)
            reached = values["time_to_accuracy_s"]
            self.progress(f"{state.tag} time to accuracy {target:g}: "
                          + (f"{reached:.2f}s of training" if reached != float("inf") else "not reached"))
        self.writer.finalize(state.stored, cell.status, **values)
        self.cells.append(cell)
        if cell.status != "ok":
            self.progress(f"{state.tag} {cell.status}: {cell.message}")
        return cell

    def interrupted(self, state: "CellState") -> None:
        self.finish(state, Outcome("interrupted", "stopped by Ctrl-C while this cell ran"))

    def waiting(self, state: "CellState", seconds: float) -> None:
        self.progress(f"{state.tag} still running ({seconds:.0f}s)")

    # --- rows -------------------------------------------------------------------------------
    @staticmethod
    def _mfu(row: dict[str, Any], state: "CellState") -> dict[str, Any]:
        """achieved_flops (a training sample costs model.TRAIN_FLOPS_FACTOR forward passes) and mfu,
        the fraction of the measured peak, for a timed row."""
        phase, rate = row.get("phase"), row.get("samples_per_s")
        if phase not in ("train_epoch", "inference") or not rate:
            return {}
        passes = model.TRAIN_FLOPS_FACTOR if phase == "train_epoch" else 1
        achieved = passes * state.base["flops_per_sample"] * rate
        peak = state.base.get("peak_flops")
        return {"achieved_flops": achieved, "mfu": achieved / peak if peak else None}

    def _peak_too_low(self, state: "CellState", row: dict[str, Any]) -> str:
        """A timed row above 100% MFU: the peak is wrong (a probe taken under load, a low
        --peak-tflops). Say so on the row, and drop the cached probe so the next run measures again."""
        from . import peaks

        first = state.peak_dropped is None
        if first:
            state.peak_dropped = bool(state.peak_key) and peaks.forget(state.peak_key)
        why = (f"MFU {row['mfu']:.0%} is above 100%: the peak ({state.base.get('peak_source')}) is too low"
               + ("; the cached probe is dropped, the next run probes again" if state.peak_dropped else ""))
        if first:  # once per cell on the terminal; every such row says it in the CSV
            self.progress(f"{state.tag} {why}")
        return "; ".join(m for m in (row.get("message"), why) if m)

    def _write(self, state: "CellState", row: dict[str, Any]) -> dict[str, Any]:
        """Write one row of the cell now, as ``pending``; returns the full row (checks read it)."""
        full = {**state.base, **{k: v for k, v in row.items() if k != "type"}, "status": PENDING}
        full["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        state.stored.append(self.writer.write(full))
        return full

    def _progress_row(self, msg: dict[str, Any], state: "CellState") -> None:
        phase, cell, tag, w = msg.get("phase"), state.cell, state.tag, state.group.workload
        if phase == "train_epoch":
            cell.epoch_seconds.append(msg["seconds"])
            cell.val_accuracy = msg.get("val_accuracy")
            self.progress(f"{tag} epoch {msg['epoch']}/{w.training.epochs}  loss {msg['loss']:.4f}  "
                          f"acc {msg['accuracy']:.3f}  val_acc {msg['val_accuracy']:.3f}  {msg['seconds']:.2f}s  "
                          f"{msg.get('samples_per_s') or 0:.0f} samples/s")
        elif phase == "build":
            extra = f" ({msg['message']})" if msg.get("message") else ""
            self.progress(f"{tag} built {msg.get('params')} params in {msg['seconds']:.2f}s{extra}")
        elif phase == "tune":
            self.progress(f"{tag} tuned in {msg['seconds']:.1f}s: {msg.get('message')}")
        elif phase == "parity" and msg.get("steps"):
            self.progress(f"{tag} trajectory: {msg.get('message')}")
        elif phase == "parity":
            self.progress(f"{tag} parity vs NumPy reference: max abs {msg['parity_max_abs']:.2g}, "
                          f"max rel {msg['parity_max_rel']:.2g}")
        elif phase == "inference":
            cell.inference_seconds.append(msg["seconds"])
            if msg["epoch"] == w.inference.repeats:
                steady = cell.inference_seconds[1:] or cell.inference_seconds
                self.progress(f"{tag} inference x{msg['epoch']}: first {cell.inference_seconds[0]:.3f}s, "
                              f"steady median {np.median(steady):.3f}s")


@dataclass
class CellState:
    """A running cell: its group, result, the columns every row of it carries, its rows so far."""

    group: Group
    cell: CellResult
    base: dict[str, Any]
    tag: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: The writer's own copies of this cell's rows, which ``finalize`` gives the cell's status.
    stored: list[dict[str, Any]] = field(default_factory=list)
    #: The GEMM-peak cache entry this cell's MFU uses ("" when none), dropped when shown too low.
    peak_key: str = ""
    #: None until a row showed the peak too low; then whether the cached probe was dropped.
    peak_dropped: Optional[bool] = None


def check_backends(names: list[str]) -> None:
    """Raise for unknown names, and when none of the requested backends is installed."""
    from .errors import BackendUnavailable

    specs = [backends.get(n) for n in names]
    problems = []
    for spec in specs:
        try:
            backends.require(spec)
        except BackendUnavailable as exc:
            problems.append(str(exc))
    if len(problems) == len(specs):
        raise BackendUnavailable("; ".join(problems))
