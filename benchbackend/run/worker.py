"""One cell (workload x backend x mode x precision, one repeat), inside the backend's own interpreter.

``python -m benchbackend.run.worker`` reads a JSON job on stdin and writes one JSON line per message
on stdout (the protocol); anything the framework prints goes to stderr. Messages:

- ``{"type": "info", ...}``     backend version, device, mode, precision, gpu, python, threads,
  math_mode, data_on_device
- ``{"type": "peak", "flops", "source", "cache_key"}``  the peak MFU is measured against
- ``{"type": "row", ...}``      one measurement (phase build / tune / parity / train_epoch / inference)
- ``{"type": "unavailable", "message"}``  the backend, mode, precision or device is not there
- ``{"type": "error", "message", "traceback"}``  the cell failed
- ``{"type": "done"}``

``python -m benchbackend.run.worker --probe module:Class`` prints ``{"version", "devices"}`` for ``list``.

The job (``launch.Job``) names the adapter by ``target`` (``module:Class``), so a backend registered
anywhere (a plug-in, a test) runs without this module knowing it, and carries the capabilities its
registry entry declares (a GEMM probe, thread control), which are all this module relies on.
The backend's environment variables are already in this process's environment (the parent sets
them, unconditionally) before the adapter, and so the framework, is imported.

The order inside a cell: import the adapter, load data, decide the data placement rule
(``Backend.place_data``), build + load the shared initial weights + put the arrays on the device
(timed together as the ``build`` row), tune (timed, when the mode tunes), forward parity on a
fixed batch against the NumPy float64 reference, the optional trajectory check, then (if the
backend trains) timed epochs, each followed by an untimed validation pass, and timed inference
passes; or, with ``--generate``, instead of training and inference, the generation passes
(``run/generation.py``). Every timed region ends with the result materialized on the host and the device synced,
by this module, not the adapter. A NaN/inf training loss stops training (the rows are kept).
With ``--scenario`` the inference passes are an MLPerf scenario on LoadGen instead (``run/scenario.py``).

Over 400 lines: a cell's whole order, build to the last pass, reads top to bottom in this one
module (the clock, the sync and what the first dispatch cost are ``timing``'s).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..backends.spec import load_class
from .launch import Job

Emit = Callable[[dict[str, Any]], None]
EVAL_BATCH = 1024  # validation and parity batches (outside the clock)


def _load_arrays(path: str) -> dict[str, np.ndarray]:
    from ..data.datasets import normalize

    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for k in ("x_train", "x_val", "x_test"):
        arrays[k] = normalize(arrays[k])
    return arrays


class Repeat:
    """One repeat of one (workload, backend, mode, precision) inside this process."""

    def __init__(self, backend: Any, workload: Any, arrays: dict[str, np.ndarray], emit: Emit,
                 cores: Optional[float] = None, started: Optional[float] = None):
        from .timing import FirstDispatch

        self.backend, self.workload, self.arrays, self.emit = backend, workload, arrays, emit
        self.dispatch = FirstDispatch(started)  # compile_s and first_result_s, from the first two epochs (passes)
        self.device_arrays: dict[str, Any] = {}
        #: The cores the cell runs on (its threads x replicas), and what other processes did to them
        #: during the last timed region (``machine``): the columns every timed row carries.
        self.cores = cores
        self.load: dict[str, Optional[float]] = {}

    def region(self, fn: Callable[[], Any], host: bool = True) -> tuple[Any, float]:
        """Time ``fn`` up to a synced device, the result materialized on the host (if ``host``).
        Outside the clock, on each side: a look at the machine (``self.load``)."""
        from . import machine
        from .timing import timed_region

        throttled, start = machine.throttle_count(), machine.snapshot()
        out = timed_region(fn, self.backend.to_host if host else None, self.backend.sync)
        end, after = machine.snapshot(), machine.throttle_count()
        self.load = {"foreign_cpu_share": machine.foreign_share(start, end, self.cores),
                     "throttle_events": None if throttled is None or after is None else after - throttled}
        return out

    def on_device(self, split: str) -> Any:
        if split not in self.device_arrays:
            self.device_arrays[split] = self.backend.to_device(self.arrays[f"x_{split}"])
        return self.device_arrays[split]

    @property
    def val_split(self) -> str:
        """The split each epoch is validated on: ``val``, or ``test`` when the workload has none."""
        return "val" if len(self.arrays["y_val"]) else "test"

    def placed_bytes(self, trains: bool) -> int:
        """Bytes of the arrays ``place`` puts on the device (as float32 inputs, integer labels)."""
        splits = ["test"] + (["train", self.val_split] if trains else [])
        return sum(self.arrays[f"x_{s}"].size * 4 + (self.arrays[f"y_{s}"].size * 8 if s == "train" else 0)
                   for s in set(splits))

    def place(self, trains: bool) -> None:
        """The data placement rule (``Backend.place_data``): the training arrays and the splits the
        validation and inference passes read, where the backend holds them. The worker times this
        in the ``build`` row, so no timed epoch or pass pays a one-off copy."""
        if trains:
            self.backend.set_data(self.arrays["x_train"], self.arrays["y_train"])
            self.on_device(self.val_split)
        self.on_device("test")

    # The three inference paths, all derived from ``scores``.
    def forward(self, x: np.ndarray) -> np.ndarray:
        """Parity: probabilities of a host batch, as float64."""
        b = self.backend
        out = b.to_host(b.scores(b.to_device(np.ascontiguousarray(x, np.float32)), EVAL_BATCH))
        return np.asarray(out, np.float64)

    def evaluate(self, split: str) -> tuple[float, float]:
        """Validation (outside the clock): (cross-entropy, accuracy) of ``split``."""
        from ..backends.base import accuracy, cross_entropy

        labels = self.arrays[f"y_{split}"]
        if len(labels) == 0:
            return float("nan"), float("nan")
        probs = np.asarray(self.backend.to_host(self.backend.scores(self.on_device(split), EVAL_BATCH)))
        return cross_entropy(probs, labels), accuracy(probs, labels)

    def predict(self) -> tuple[np.ndarray, float]:
        """One timed inference pass over the test set at the workload's inference batch size."""
        x = self.on_device("test")
        return self.region(lambda: self.backend.scores(x, self.workload.inference.batch_size))


def _parity(cell: Repeat, weights: list[np.ndarray], steps: int, base: dict[str, Any], trains: bool = True,
            replicas: int = 1) -> list[float]:
    """Forward parity and, with ``steps``, the trajectory check; returns the trajectory's step losses
    (what epoch 1's first steps must report: ``loss_audit``), [] without it."""
    from ..backends.numpy import reference
    from . import truth
    from .checks import parity_errors

    workload, arrays = cell.workload, cell.arrays
    pool = arrays["x_val"] if len(arrays["x_val"]) else arrays["x_train"]
    rng = np.random.default_rng([workload.seed, 7])
    idx = np.sort(rng.choice(len(pool), size=min(workload.checks.parity_batch, len(pool)), replace=False))
    x = pool[idx]
    ref = reference.forward(workload, weights, x.astype(np.float64), dtype=np.float64)
    max_abs, max_rel = parity_errors(cell.forward(x), ref)
    cell.emit({**base, "phase": "parity", "samples": len(x), "parity_max_abs": max_abs, "parity_max_rel": max_rel})
    if trains and any(layer.type == "batchnorm" for layer in workload.model):
        # Batchnorm computes differently in a training step (batch statistics): check that mode too.
        ref = reference.forward(workload, weights, x.astype(np.float64), dtype=np.float64, training=True)
        b = cell.backend
        out = b.to_host(b.train_scores(b.to_device(np.ascontiguousarray(x, np.float32))))
        max_abs, max_rel = parity_errors(np.asarray(out, np.float64), ref)
        cell.emit({**base, "phase": "parity", "samples": len(x), "parity_max_abs": max_abs,
                   "parity_max_rel": max_rel, "notes": "training mode (batch statistics)"})
    if steps <= 0:
        return []
    bs = workload.training.batch_size
    order = arrays["orders"][0]
    batch_list = [(arrays["x_train"][order[i * bs:(i + 1) * bs]], arrays["y_train"][order[i * bs:(i + 1) * bs]])
                  for i in range(steps) if i * bs < len(order)]
    if replicas > 1 and any(layer.type == "batchnorm" for layer in workload.model):
        # Batch statistics per replica (``replicas``): the reference computes them per shard too.
        ref_losses = truth.sharded_losses(workload, weights, batch_list, replicas)
    else:
        ref_losses = truth.trajectory(workload, weights, batch_list)
    losses = [float(v) for v in cell.backend.train_steps(batch_list)]
    # Raw values only: checks.trajectory decides, with the workload's tolerance.
    cell.emit({**base, "phase": "parity", "steps": len(losses), "losses": losses,
               "reference_losses": [float(v) for v in ref_losses]})
    return losses


def run_job(job: Job, emit: Emit, started: Optional[float] = None) -> None:
    """Run one cell and stream its messages through ``emit`` (also usable in-process by tests);
    ``started``: the process's start (epoch seconds), else now (``first_result_s`` counts from it)."""
    started = started or time.time()
    from ..errors import BackendUnavailable
    from ..spec.replicas import scaled

    o = job.options  # --scale-lr, --scaling: the lr and global batch the replicas train
    workload = scaled(job.workload, o.replicas, o.scale_lr, o.scaling)
    try:
        cls = load_class(job.target)
        backend = cls(workload, job.device, job.mode, job.precision, job.options)
    except (BackendUnavailable, ImportError) as exc:
        emit({"type": "unavailable", "message": str(exc).splitlines()[0] if str(exc) else repr(exc)})
        return
    if job.generate and backend.generation_note:  # before any work: this backend cannot generate
        emit({"type": "unavailable", "message": f"{job.backend}: {backend.generation_note}"})
        backend.close()
        return
    try:
        with _compile_cache(o.compile_cache):
            _run(job, backend, workload, emit, started)
    finally:
        backend.close()  # the replica processes of a data-parallel cell, say


@contextmanager
def _compile_cache(setting: str) -> Iterator[None]:
    """``--compile-cache cold``: the cell's compiled programs go to an empty folder, removed after it
    (``paths.compile_cache_dir``); the variables the cell set are put back either way (a test runs
    many cells in one process)."""
    names = ("BENCHBACKEND_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR")
    before = {name: os.environ.get(name) for name in names}
    folder = tempfile.mkdtemp(prefix="benchbackend-cold-") if setting == "cold" else None
    if folder:
        os.environ["BENCHBACKEND_COMPILE_CACHE"] = folder
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _run(job: Job, backend: Any, workload: Any, emit: Emit, started: float) -> None:
    from ..errors import BackendUnavailable
    from ..results import canonical_device, environment
    from ..spec.model import initial_weights, param_count
    from . import machine

    arrays = _load_arrays(job.data)
    weights = initial_weights(workload, job.repeat)
    threads = _threads(backend, job)
    device = canonical_device(backend.device_id())
    cell = Repeat(backend, workload, arrays, emit, cores=(threads or os.cpu_count() or 1) * job.options.replicas,
                  started=started)
    base: dict[str, Any] = {"type": "row"}
    on_device = bool(backend.place_data(cell.placed_bytes(job.trains)))
    kept = backend.compile_cache()  # before anything compiles; holding programs already: a warm cell
    emit({"type": "info", **environment(), "backend_version": backend.version(), "device": device,
          "mode": backend.mode, "precision": backend.precision, "gpu": backend.gpu_name(),
          "python": platform.python_version(), "threads": threads, "math_mode": backend.math_mode(),
          "data_on_device": on_device, "machine": machine.cell_readings(device),
          "compile_cache": "" if kept is None else job.options.compile_cache,
          "compile_cache_hit": None if kept is None else bool(kept.is_dir() and any(kept.iterdir()))})

    def build_and_place() -> int:
        params = backend.build(weights)
        cell.place(job.trains)  # the one-off copy to the device, timed here (see Repeat.place)
        return params

    backend.reset_device_peak()  # the cell's own peak (an earlier cell may have run in this process)
    try:
        params, seconds = cell.region(build_and_place, host=False)
    except BackendUnavailable as exc:  # e.g. a GPU provider that only fails to load at build time
        emit({"type": "unavailable", "message": str(exc).splitlines()[0]})
        return
    expected = param_count(workload)
    if params != expected:
        raise RuntimeError(f"{job.backend} built {params} parameters; the spec has {expected}")
    notes = [f"{k} {v}" for k, v in backend.details().items()]
    if not on_device:
        notes.append(f"data copied per batch inside the clock: {backend.data_note}")
    emit({**base, "phase": "build", "seconds": seconds, "params": params, **_memory(backend), **cell.load,
          "notes": "; ".join(notes)})
    checking = time.time()  # the harness's own work (probe, parity) is no part of the time to a first result
    peak = _peak(backend, job)
    cell.dispatch.exclude(time.time() - checking)
    if peak is not None:
        emit({"type": "peak", **peak})
        backend.reset_device_peak()  # the probe's matrices are not the cell's
    summary, seconds = cell.region(backend.tune, host=False)
    if summary is not None:
        emit({**base, "phase": "tune", "seconds": seconds, "notes": summary, **cell.load})

    parity_steps = job.parity_steps if job.trains else 0
    checking = time.time()
    trajectory = _parity(cell, weights, parity_steps, base, job.trains, job.options.replicas)
    if parity_steps:
        backend.build(weights)  # the trajectory check trained a few steps: start over from the shared weights
        backend.set_data(arrays["x_train"], arrays["y_train"])
    cell.dispatch.exclude(time.time() - checking)
    if job.generate:  # instead of the inference passes: generation with a key/value cache
        from . import generation

        try:
            generation.run(cell, weights, base, _memory)
        except BackendUnavailable as exc:  # a mode or precision the backend cannot generate in
            emit({"type": "unavailable", "message": str(exc).splitlines()[0]})
        return
    if job.trains and not _train(cell, base, trajectory, job.options.replicas):
        return  # nan_loss: stop this repeat; its rows are kept
    if workload.loadgen is not None and workload.loadgen.scenario:  # --scenario: MLPerf LoadGen's instead
        from . import scenario

        return scenario.run(cell, base, _memory, job, None if job.trains else weights)
    _infer(cell, base)


def _infer(cell: Repeat, base: dict[str, Any]) -> None:
    """The timed inference passes over the test set (the first carries warm-up), each audited
    outside the clock: its outputs of a seeded share of the samples (``checks.audit_indices``) must
    be what an untimed pass of those samples alone gives (``checks.audit``); a pass that returns
    cached, stale or skipped outputs is timed as fast, and this is what sees it."""
    from ..backends.base import accuracy
    from .checks import audit, audit_indices

    labels = cell.arrays["y_test"]
    picked = audit_indices(len(labels), cell.workload.seed)
    untimed = cell.forward(cell.arrays["x_test"][picked]) if len(picked) else None
    tol = cell.workload.checks.tolerance(cell.backend.precision)
    batches = -(-len(labels) // cell.workload.inference.batch_size)
    for i in range(1, cell.workload.inference.repeats + 1):
        began = time.time()
        scores, seconds = cell.predict()
        scores = np.asarray(scores)
        found = audit(scores[picked], untimed, tol.rtol, tol.atol) if untimed is not None else None
        checked = {"audited": len(picked)}
        if found is not None:
            sample = int(picked[found[0]])
            checked.update(audit_sample=sample, notes=f"timed inference pass {i}, test sample {sample}: {found[1]} "
                                                      f"from an untimed pass of the audited samples")
        cell.emit({**base, "phase": "inference", "pass": i, "samples": len(labels), "seconds": seconds,
                   "samples_per_s": len(labels) / seconds if seconds > 0 else None,
                   "accuracy": accuracy(scores, labels), **checked, **_memory(cell.backend), **cell.load,
                   **cell.dispatch.see("inference", i, began, seconds, batches)})


def _train(cell: Repeat, base: dict[str, Any], trajectory: Optional[list[float]] = None, replicas: int = 1) -> bool:
    """Timed epochs, each followed by an untimed validation pass, each audited through its step
    losses outside the clock (``loss_audit``; ``trajectory``: the trajectory check's losses, what
    epoch 1's first steps must report). False when a loss went NaN/inf."""
    from .loss_audit import Audit

    arrays, workload, backend = cell.arrays, cell.workload, cell.backend
    audit = Audit(cell, trajectory, replicas)
    n_train = len(arrays["y_train"])
    val_split = cell.val_split
    n_val = len(arrays[f"y_{val_split}"])
    steps = -(-n_train // workload.training.batch_size)
    backend.comm_seconds()  # the trajectory check's steps communicated too: not an epoch's
    for epoch, order in enumerate(arrays["orders"][: workload.training.epochs], start=1):
        checking = time.time()
        audit.before(epoch, order)  # the loss its first step must report, from the epoch's starting weights
        if epoch == 1:  # the harness's own work, no part of the time to a first result
            cell.dispatch.exclude(time.time() - checking)
        backend.barrier()  # replicas that each run the whole cell line up outside the clock
        began = time.time()
        (loss, acc), seconds = cell.region(lambda: backend.train_epoch(order))
        load = cell.load  # the epoch's, before validation (untimed) runs
        comm = backend.comm_seconds()
        loss, acc = float(loss), float(acc)
        audited = audit.after(epoch, loss, n_train)
        finite = bool(np.isfinite(loss))
        val_loss, val_acc = cell.evaluate(val_split) if finite else (float("nan"), float("nan"))
        cell.emit({**base, "phase": "train_epoch", "epoch": epoch, "samples": n_train, "seconds": seconds,
                   "samples_per_s": n_train / seconds if seconds > 0 else None, "loss": loss, "accuracy": acc,
                   "val_loss": val_loss, "val_accuracy": val_acc, "val_samples": n_val, "steps": steps,
                   "comm_s": comm, **audited, **_memory(backend), **load,
                   **cell.dispatch.see("train", epoch, began, seconds, steps)})
        if not finite:
            return False
    return True


def _memory(backend: Any) -> dict[str, Optional[float]]:
    """The memory columns of a row: the process's peak resident memory, and the device's peak from
    the framework's own counter (None on a CPU and where there is none)."""
    from .timing import peak_rss_mb

    device = backend.peak_device_mb()
    return {"peak_rss_mb": peak_rss_mb(), "peak_device_mb": None if device is None else float(device)}


def _peak(backend: Any, job: Job) -> Optional[dict[str, Any]]:
    """The peak for MFU: the best GEMM probe taken on this device in this precision with these
    threads (:mod:`benchbackend.run.peaks`; ``--peak-tflops`` is a second denominator, the runner's).
    A backend whose registry entry declares a probe adds its own framework's once; a CPU cell of one
    without adds NumPy's. None when no probe exists for the device (a GPU runtime without its own,
    before any other probed)."""
    from ..results import canonical_device, environment
    from . import peaks

    env = environment()
    device = canonical_device(backend.device_id())  # TensorFlow's cpu:0 is the cpu of the others
    k = peaks.key(env["host"], backend.gpu_name() or env["cpu"], device, backend.precision,
                  _threads(backend, job))
    own = job.capabilities.peak_probe
    prober = backend.name if own else "numpy"
    fresh = False
    if prober not in peaks.probes(k) and (own or device == "cpu"):
        flops = backend.gemm_peak(backend.precision) if own else peaks.numpy_gemm_peak(backend.precision)
        shared = peaks.sharers(device)
        if flops and shared:  # read low beside them (issue 42: 23 TFLOP/s of an H100's 52): this cell's alone
            cached = peaks.best(k)
            if cached is None or cached[0] < flops:
                return {"flops": float(flops), "source": f"{prober} GEMM probe (not cached: {shared:g} other "
                                                         f"process(es) on the GPU)"}
        elif flops:
            peaks.store(k, prober, float(flops))
            fresh = True
    found = peaks.best(k)
    if found is None:
        return None
    flops, by, when = found
    source = f"{by} GEMM probe" + ("" if fresh and by == prober else f" (cached {when})")
    n = job.options.replicas
    if n > 1:  # the probe is one replica's (its threads, its device); the cell runs N of them
        flops, source = flops * n, f"{source} x {n} replicas"
    return {"flops": flops, "source": source, "cache_key": k}


def _threads(backend: Any, job: Job) -> Optional[int]:
    """The intra-op threads the cell uses: the framework's own count where the adapter controls
    threads, else what ``--threads`` asked (or every core)."""
    if job.capabilities.thread_control:
        return backend.threads()
    return job.options.threads or os.cpu_count()


def _probe(target: str) -> dict[str, Any]:
    return load_class(target).probe()


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
        if argv[:1] == ["--probe"]:  # argv[1]: "module:Class"
            emit(_probe(argv[1]))
            return 0
        from .timing import process_start

        run_job(Job.from_json(sys.stdin.read()), emit, process_start())
        emit({"type": "done"})
        return 0
    except Exception as exc:  # the parent turns this into a `crashed` row with the traceback tail
        lines = str(exc).strip().splitlines()
        emit({"type": "error", "message": f"{type(exc).__name__}: {lines[0] if lines else ''}",
              "traceback": traceback.format_exc()})
        return 1


if __name__ == "__main__":
    # The parent reads a cell's end at this process's exit; the interpreter's own teardown
    # (TensorFlow's about 1 s, torch's 0.7 s: module finalizers, thread pools) measures nothing,
    # and every file this module writes is closed by now. So exit at once.
    code = main()
    sys.stderr.flush()
    os._exit(code)
