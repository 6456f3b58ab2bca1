"""The knob audit: each backend's performance settings, at their default and at the alternative.

For every knob, the same small cell (one workload, backend, mode, precision) runs with the knob
at the setting the harness uses and at the alternative, each in a fresh worker process
(``python -m benchbackend.run.worker``'s ``main``, as ``run`` starts it), the two interleaved
(A B A B ...) so drift of the machine hits both alike. It prints, per setting, the median steady
training and inference samples/s (each repeat's median without its first epoch or pass, then the
median over repeats), the cores the steady epochs kept busy (the worker's CPU time over the wall
time of each timed region: a multi-threaded framework on 2 free cores reads near 2), and the
cell's status from the harness's own checks (``checks.cell_status``: forward parity against the
NumPy reference, the ``--parity-steps`` trajectory, the timed-output audits), so a faster
setting that changes the arithmetic shows as ``parity_mismatch``. The effect is alternative over
default, minus one, on training samples/s (inference for the inference-only runtimes).

A knob is set one of four ways (``Setting``): an environment variable (``TF_ENABLE_ONEDNN_OPTS``,
``XLA_FLAGS``), the run's threads (``--threads``), another mode of the backend, or a line of
Python run in the worker before the job (``torch.backends.mkldnn.enabled = False``; a patch of
an adapter's function, for a setting the adapter hard-codes: ONNX Runtime's optimisation level,
TVM's target): nothing in the package changes for an audit.

    python benchmarks/knobs.py --list
    python benchmarks/knobs.py --backend torch --limit 1024 --epochs 3 --repeats 2
    python benchmarks/knobs.py --knob jax.one_core --knob jax.xnnpack_off --workload vit-tiny
    python benchmarks/knobs.py --backend onnxruntime --backend openvino --backend tvm --markdown

This is a figure, not a test: nothing here passes or fails. The table in docs/backends.md
("Knobs") is its ``--markdown`` output, measured under the project's heavy-work lock.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend.backends import registry as backends  # noqa: E402
from benchbackend.backends.base import Options  # noqa: E402
from benchbackend.data import arrays  # noqa: E402
from benchbackend.run import checks  # noqa: E402
from benchbackend.run.launch import Job, python_for, worker_environ  # noqa: E402
from benchbackend.spec import workload as W  # noqa: E402

#: Run in every worker before the job: each timed region also records the process's CPU time over
#: its wall time (``knob_cores``, carried in the row like the machine's load columns).
CORES = """
import time
from benchbackend.run import worker as _w
_region = _w.Repeat.region
def _counted(self, fn, host=True):
    c0, t0 = time.process_time(), time.perf_counter()
    out = _region(self, fn, host)
    self.load = {**self.load, "knob_cores": (time.process_time() - c0) / max(time.perf_counter() - t0, 1e-9)}
    return out
_w.Repeat.region = _counted
"""
MAIN = """
code = _w.main()
sys.stderr.flush()
os._exit(code)
"""

# Patches for what an adapter hard-codes (run in the worker, before the job).
_ORT_LEVEL = """
import onnxruntime as ort
class _Session(ort.InferenceSession):
    def __init__(self, model, sess_options=None, *a, **k):
        sess_options.graph_optimization_level = ort.GraphOptimizationLevel.{level}
        super().__init__(model, sess_options, *a, **k)
ort.InferenceSession = _Session
"""
_ORT_PARALLEL = """
import onnxruntime as ort
class _Session(ort.InferenceSession):
    def __init__(self, model, sess_options=None, *a, **k):
        sess_options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        sess_options.inter_op_num_threads = 2
        super().__init__(model, sess_options, *a, **k)
ort.InferenceSession = _Session
"""
_TVM_MCPU = """
import tvm
from benchbackend.backends.tvm import adapter as _a
_a.host_target = lambda threads: tvm.target.Target({{"kind": "llvm", "mcpu": "{mcpu}", "num-cores": threads}})
"""
_JAX_PRECISION = """
import jax
from benchbackend.backends.jax import adapter as _a
_set = _a.set_math
def _default_precision(device, precision, backend):
    mode = _set(device, precision, backend)
    jax.config.update("jax_default_matmul_precision", {value!r})
    return mode
_a.set_math = _default_precision
"""
_ONE_CORE = "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"


@dataclass(frozen=True)
class Setting:
    """One value of a knob: environment variables, threads, a mode, or Python run before the job."""

    label: str
    env: dict[str, str] = field(default_factory=dict)
    threads: Optional[int] = None
    mode: Optional[str] = None
    code: str = ""


@dataclass(frozen=True)
class Knob:
    name: str
    backend: str
    mode: str
    #: The framework's own default and what the harness sets (the table's columns).
    default_is: str
    harness: str
    default: Setting
    alternative: Setting
    workload: Optional[str] = None  # None: the command line's --workload


def _xla(flags: str) -> dict[str, str]:
    return {"XLA_FLAGS": flags}


#: glibc's own variables (read as the process starts): nothing over 2 GB is mmap'd, nothing trimmed.
_HEAP_KEPT = backends.HEAP_KEPT
#: Unset (an empty value removes the variable the backend's own environment sets).
_GLIBC_DEFAULT = {name: "" for name in _HEAP_KEPT}

KNOBS: list[Knob] = [
    # torch
    Knob("torch.threads", "torch", "eager", "all cores (torch.get_num_threads)",
         "--threads N: torch.set_num_threads + OMP/MKL vars; else untouched",
         Setting("all cores"), Setting("1 thread", threads=1)),
    Knob("torch.interop", "torch", "eager", "all cores", "untouched",
         Setting("inter-op default"), Setting("inter-op 1", code="import torch; torch.set_num_interop_threads(1)")),
    Knob("torch.mkldnn", "torch", "eager", "on (torch.backends.mkldnn.enabled)", "untouched (on)",
         Setting("oneDNN on"), Setting("oneDNN off", code="import torch; torch.backends.mkldnn.enabled = False")),
    Knob("torch.channels_last", "torch", "eager", "NCHW (contiguous)", "mode `channels_last`",
         Setting("NCHW"), Setting("channels_last", mode="channels_last")),
    Knob("torch.cpp_wrapper", "torch", "compile", "off (inductor config.cpp_wrapper)", "untouched (off)",
         Setting("python wrapper"),
         Setting("cpp_wrapper", code="import torch._inductor.config as c; c.cpp_wrapper = True")),
    Knob("torch.max_autotune", "torch", "compile", "off (mode='default')", "untouched (off)",
         Setting("default"),
         Setting("max-autotune", code="import torch._inductor.config as c; c.max_autotune = True")),
    # tensorflow
    Knob("tf.threads", "tensorflow", "tf.function", "all cores", "--threads N: intra- and inter-op N",
         Setting("all cores"), Setting("1 thread", threads=1)),
    Knob("tf.interop", "tensorflow", "tf.function", "all cores", "--threads N sets it to N; else untouched",
         Setting("inter-op default"), Setting("inter-op 1", env={"TF_NUM_INTEROP_THREADS": "1"})),
    Knob("tf.onednn", "tensorflow", "tf.function", "on (x86 Linux)", "untouched (on)",
         Setting("oneDNN on"), Setting("oneDNN off", env={"TF_ENABLE_ONEDNN_OPTS": "0"})),
    Knob("tf.xla", "tensorflow", "tf.function", "off (jit_compile=None)", "mode `xla`: jit_compile=True",
         Setting("tf.function"), Setting("XLA", mode="xla")),
    Knob("tf.xla_onednn_off", "tensorflow", "tf.function", "oneDNN on", "-",
         Setting("tf.function, oneDNN off", env={"TF_ENABLE_ONEDNN_OPTS": "0"}), Setting("XLA", mode="xla")),
    # jax
    Knob("jax.threads", "jax", "jit", "one Eigen pool of all schedulable cores", "--threads N: OMP/MKL vars only",
         Setting("default"), Setting("--threads 1", threads=1)),
    Knob("jax.one_core", "jax", "jit", "all schedulable cores", "untouched",
         Setting("2 cores"), Setting("1 core (affinity)", code=_ONE_CORE)),
    Knob("jax.pjrt_nproc", "jax", "jit", "all schedulable cores (PJRT_NPROC unset)", "--threads N: PJRT_NPROC=N",
         Setting("all cores"), Setting("PJRT_NPROC=1", env={"PJRT_NPROC": "1"})),
    Knob("jax.eigen_single", "jax", "jit", "--xla_cpu_multi_thread_eigen=true", "untouched",
         Setting("multi-thread Eigen"), Setting("single-thread Eigen", env=_xla("--xla_cpu_multi_thread_eigen=false"))),
    Knob("jax.xnnpack_off", "jax", "jit", "--xla_cpu_use_xnnpack (XLA's default)", "untouched",
         Setting("default"), Setting("xnnpack off", env=_xla("--xla_cpu_use_xnnpack=false"))),
    Knob("jax.xnnpack_on", "jax", "jit", "--xla_cpu_use_xnnpack (XLA's default)", "untouched",
         Setting("default"), Setting("xnnpack on", env=_xla("--xla_cpu_use_xnnpack=true"))),
    Knob("jax.onednn", "jax", "jit", "--xla_cpu_use_onednn=false", "untouched",
         Setting("default"), Setting("oneDNN on", env=_xla("--xla_cpu_use_onednn=true"))),
    Knob("jax.vector512", "jax", "jit", "--xla_cpu_prefer_vector_width=256", "untouched",
         Setting("256-bit"), Setting("512-bit", env=_xla("--xla_cpu_prefer_vector_width=512"))),
    Knob("jax.matmul_precision", "jax", "jit", "None (the backend's default)", "'highest' for fp32 (strict IEEE)",
         Setting("highest"), Setting("default", code=_JAX_PRECISION.format(value="default"))),
    Knob("jax.malloc", "jax", "jit", "glibc: buffers over 128 KiB mmap'd, freed to the OS", "untouched",
         Setting("glibc default"),
         Setting("heap-kept buffers", env={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                                            "glibc.malloc.trim_threshold=4294967296"})),
    Knob("jax.prng", "jax", "jit", "threefry2x32 (jax_default_prng_impl)", "untouched (threefry)",
         Setting("threefry"),
         Setting("unsafe_rbg", code="import jax; jax.config.update('jax_default_prng_impl', 'unsafe_rbg')")),
    # NumPy's heap: Chainer's and the reference's arrays are NumPy's, each step's activations fresh
    Knob("chainer.malloc", "chainer", "define-by-run", "glibc: arrays over 128 KiB mmap'd, freed to the OS",
         "heap-kept (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` 2 GB)", Setting("heap-kept arrays"),
         Setting("glibc default", env=_GLIBC_DEFAULT)),
    Knob("numpy.malloc", "numpy", "reference", "glibc: arrays over 128 KiB mmap'd, freed to the OS",
         "heap-kept (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` 2 GB)", Setting("heap-kept arrays"),
         Setting("glibc default", env=_GLIBC_DEFAULT)),
    Knob("torch.malloc", "torch", "eager", "glibc: buffers over 128 KiB mmap'd, freed to the OS",
         "untouched", Setting("glibc default"), Setting("heap-kept buffers", env=_HEAP_KEPT)),
    Knob("tf.malloc", "tensorflow", "tf.function", "glibc: buffers over 128 KiB mmap'd, freed to the OS",
         "untouched", Setting("glibc default"), Setting("heap-kept buffers", env=_HEAP_KEPT)),
    # onnxruntime
    Knob("ort.threads", "onnxruntime", "default", "all cores", "--threads N: intra_op_num_threads",
         Setting("all cores"), Setting("1 thread", threads=1)),
    Knob("ort.optimization", "onnxruntime", "default", "ORT_ENABLE_ALL", "ORT_ENABLE_ALL",
         Setting("ENABLE_ALL"), Setting("ENABLE_BASIC", code=_ORT_LEVEL.format(level="ORT_ENABLE_BASIC"))),
    Knob("ort.parallel", "onnxruntime", "default", "ORT_SEQUENTIAL", "untouched (sequential)",
         Setting("sequential"), Setting("parallel, inter-op 2", code=_ORT_PARALLEL)),
    # openvino
    Knob("openvino.hint", "openvino", "latency", "LATENCY (2024+)", "mode `latency` / `throughput`",
         Setting("LATENCY"), Setting("THROUGHPUT", mode="throughput")),
    Knob("openvino.threads", "openvino", "latency", "all cores", "--threads N: INFERENCE_NUM_THREADS",
         Setting("all cores"), Setting("1 thread", threads=1)),
    # tvm
    Knob("tvm.mcpu", "tvm", "default", "generic llvm (SSE2: 4 lanes)", "-mcpu=<host> (LLVM's name for this CPU)",
         Setting("-mcpu=host"), Setting("-mcpu=x86-64-v3 (AVX2)", code=_TVM_MCPU.format(mcpu="x86-64-v3"))),
    Knob("tvm.threads", "tvm", "default", "all cores", "--threads N: TVM_NUM_THREADS, -num-cores",
         Setting("all cores"), Setting("1 thread", threads=1)),
]


@dataclass
class Result:
    train: list[float] = field(default_factory=list)  # per repeat: median steady samples/s
    infer: list[float] = field(default_factory=list)
    cores: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    parity: list[float] = field(default_factory=list)  # forward parity, max relative error
    foreign: list[float] = field(default_factory=list)  # other processes' share of the cores (machine.py)


def _steady(rows: list[dict[str, Any]], phase: str, key: str = "samples_per_s") -> Optional[float]:
    values = [r[key] for r in rows if r.get("phase") == phase and r.get(key) is not None]
    return statistics.median(values[1:] if len(values) > 1 else values) if values else None


def run_cell(knob: Knob, setting: Setting, workload: W.Workload, data: str, parity_steps: int,
             timeout: float) -> tuple[list[dict[str, Any]], str]:
    """The rows of one worker process with ``setting`` applied, and its status."""
    spec = backends.get(knob.backend)
    mode = setting.mode or knob.mode
    job = Job.for_spec(spec, workload, mode=mode, precision="fp32", device="cpu", repeat=0, data=data,
                       parity_steps=parity_steps if spec.trains else 0, options=Options(threads=setting.threads))
    env = {**worker_environ(spec, "cpu", setting.threads), **setting.env, "PYTHONPATH": str(ROOT)}
    env = {name: value for name, value in env.items() if value != ""}
    code = "import os, sys\n" + setting.code + CORES + MAIN
    try:
        proc = subprocess.run([python_for(spec), "-c", code], input=job.to_json(), capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"timeout ({timeout:g} s)"
    rows, why = [], ""
    for line in proc.stdout.splitlines():
        msg = json.loads(line)
        if msg["type"] == "row":
            if msg.get("phase") == "parity" and msg.get("steps"):
                msg = checks.trajectory(msg, workload)
            rows.append(msg)
        elif msg["type"] in ("unavailable", "error"):
            why = f"{msg['type']}: {msg['message']}"
    if proc.returncode and not why:
        why = f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    if why:
        return rows, why
    return rows, checks.cell_status(rows, workload, "fp32")[0]


def sized(name: str, limit: int, epochs: int, passes: int) -> W.Workload:
    w = W.load(name).with_overrides(limit=limit, epochs=epochs)
    return w.model_copy(update={"inference": w.inference.model_copy(update={"repeats": passes})})


def measure(knob: Knob, args: argparse.Namespace, tmp: str) -> dict[str, Result]:
    spec = backends.get(knob.backend)
    w = sized(knob.workload or args.workload, args.limit, args.epochs, args.passes)
    if not spec.trains:  # the inference-only runtimes time the test set: as many samples as training has
        w = w.model_copy(update={"data": w.data.model_copy(update={"test": w.data.train})})
    path = os.path.join(tmp, f"{w.name}-{w.data.train}-{w.data.test}.npz")
    if not os.path.exists(path):
        arrays.prepare(w, "synthetic", None, Path(path))
    out = {s.label: Result() for s in (knob.default, knob.alternative)}
    for _ in range(args.repeats):
        for setting in (knob.default, knob.alternative):  # interleaved: A B A B
            rows, status = run_cell(knob, setting, w, path, args.parity_steps, args.timeout)
            r = out[setting.label]
            r.statuses.append(status)
            for phase, into in (("train_epoch", r.train), ("inference", r.infer)):
                v = _steady(rows, phase)
                if v:
                    into.append(v)
            c = _steady(rows, "train_epoch" if spec.trains else "inference", "knob_cores")
            if c:
                r.cores.append(c)
            f = _steady(rows, "train_epoch" if spec.trains else "inference", "foreign_cpu_share")
            if f is not None:
                r.foreign.append(f)
            rel = [x["parity_max_rel"] for x in rows if x.get("phase") == "parity" and not x.get("steps")
                   and x.get("parity_max_rel") is not None]
            if rel:
                r.parity.append(max(rel))
    return out


def _med(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _fmt(v: Optional[float], spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def effect(knob: Knob, res: dict[str, Result]) -> str:
    spec = backends.get(knob.backend)
    a, b = res[knob.default.label], res[knob.alternative.label]
    pick = (lambda r: r.train) if spec.trains else (lambda r: r.infer)
    d, x = _med(pick(a)), _med(pick(b))
    if not d or not x:
        return "not measured"
    return f"{100 * (x / d - 1):+.0f}% {'training' if spec.trains else 'inference'}"


def _status(r: Result) -> str:
    return "/".join(sorted(set(r.statuses))) or "-"


def report(knob: Knob, res: dict[str, Result], markdown: bool) -> str:
    a, b = res[knob.default.label], res[knob.alternative.label]
    if markdown:
        def cell(s: Setting, r: Result) -> str:
            return (f"{s.label}: {_fmt(_med(r.train))} / {_fmt(_med(r.infer))}, {_fmt(_med(r.cores), '.1f')} cores, "
                    f"{_status(r)}")
        return (f"| `{knob.name}` ({knob.backend}:{knob.mode}) | {knob.default_is} | {knob.harness} | "
                f"{cell(knob.default, a)} | {cell(knob.alternative, b)} | {effect(knob, res)} |")
    lines = []
    for s, r in ((knob.default, a), (knob.alternative, b)):
        lines.append(f"  {s.label:<28} train/s {_fmt(_med(r.train)):>7}  infer/s {_fmt(_med(r.infer)):>7}  "
                     f"cores {_fmt(_med(r.cores), '.2f'):>5}  parity {_fmt(max(r.parity) if r.parity else None, '.1e')}"
                     f"  {_status(r)}  (train {[round(v) for v in r.train]}, infer {[round(v) for v in r.infer]}, "
                     f"others' share of the cores {[round(v, 2) for v in r.foreign]})")
    return f"{knob.name} ({knob.backend}:{knob.mode}; default {knob.default_is}; harness: {knob.harness})\n" + \
        "\n".join(lines) + f"\n  effect: {effect(knob, res)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knob", action="append", default=[], help="a knob's name (repeatable; --list names them)")
    parser.add_argument("--backend", action="append", default=[], help="every knob of this backend (repeatable)")
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--limit", type=int, default=1024, help="training samples per epoch (inference-only: test)")
    parser.add_argument("--epochs", type=int, default=3, help="the first is left out of the median")
    parser.add_argument("--passes", type=int, default=4, help="inference passes (the first left out)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per setting, interleaved")
    parser.add_argument("--parity-steps", type=int, default=3, help="trajectory steps checked (training backends)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per worker")
    parser.add_argument("--markdown", action="store_true", help="print the table's rows")
    parser.add_argument("--list", action="store_true", help="list the knobs and exit")
    args = parser.parse_args()
    if args.list:
        for k in KNOBS:
            print(f"{k.name:<22} {k.backend}:{k.mode:<12} {k.default.label} -> {k.alternative.label}")
        return
    known = {k.name: k for k in KNOBS}
    unknown = [n for n in args.knob if n not in known]
    if unknown:
        sys.exit(f"unknown knob {unknown[0]!r}; --list names them")
    chosen = [known[n] for n in args.knob] + [k for k in KNOBS if k.backend in args.backend and k.name not in args.knob]
    if not chosen:
        sys.exit("name --knob or --backend (--list names the knobs)")
    print(f"{args.workload}: --limit {args.limit}, {args.epochs} epochs, {args.passes} passes, {args.repeats} "
          f"repeats; steady median samples/s (train / inference); cpu {os.cpu_count()} cores", flush=True)
    if args.markdown:
        print("| knob | framework default | harness sets | default: train/s / infer/s, cores, status | "
              "alternative | effect |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for knob in chosen:
            began = time.time()
            res = measure(knob, args, tmp)
            detail = f"{report(knob, res, False)}  [{time.time() - began:.0f} s]"
            if args.markdown:  # the row on stdout, the detail (every repeat) on stderr
                print(report(knob, res, True), flush=True)
                print(detail, file=sys.stderr, flush=True)
            else:
                print(detail, flush=True)


if __name__ == "__main__":
    main()
