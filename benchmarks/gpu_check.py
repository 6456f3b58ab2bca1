"""One command that checks every GPU path: ``python benchmarks/gpu_check.py``.

Each path (torch eager, compile, bf16 and tf32; TensorFlow; JAX; Keras 3 on JAX and on torch; the
NumPy reference on CuPy; Chainer on CuPy; ONNX Runtime CUDA; TVM CUDA; PlaidML OpenCL) is one
``benchbackend run`` of the mnist workload at a tiny size, in a subprocess: synthetic data, 1,024
training samples (at 256, one epoch leaves mnist at chance), one epoch, one repeat, and
``--parity-steps 5`` (training backends) or ``--inference-only`` (inference runtimes). Its CSV is
read back with ``results.read`` and the cell judged: ``ok``; ``unavailable`` with the reason the
run gave (clean: a framework built without CUDA, a GPU too old for tf32); or a failure (any other
status, an ``ok`` cell that ran on the CPU, a run that ended no cell). A path whose backend is not
installed, whose isolated environment is not built (``benchbackend setup NAME``) or whose adapter
takes no GPU device is skipped without a run, as is every path where ``nvidia-smi`` finds no GPU.

The report ``gpu_check.md`` and each path's CSV and log go to ``-o DIR`` (default
``results/gpu-check-<time>/``).

    python benchmarks/gpu_check.py                                   # every path
    python benchmarks/gpu_check.py --only torch-eager --only jax -o /tmp/gpu
    python benchmarks/gpu_check.py --require-gpu                     # no GPU is a failure

Exit 0 when every path that ran is ok or cleanly unavailable (so also on a machine without a GPU,
unless ``--require-gpu``), 1 otherwise. Nothing here imports an ML framework.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend import __version__, results  # noqa: E402
from benchbackend.backends import registry as backends  # noqa: E402
from benchbackend.errors import BackendUnavailable, ResultsError  # noqa: E402

WORKLOAD = "mnist"
#: What every run shares (besides --timeout and -o).
COMMON = ["--data", "synthetic", "--limit", "1024", "--epochs", "1", "--repeats", "1", "--no-plots", "-q", "--force"]
#: path -> (backend, the arguments that make it this path); --parity-steps or --inference-only follow.
PATHS: dict[str, tuple[str, list[str]]] = {
    "torch-eager": ("torch", ["--mode", "torch:eager", "--device", "cuda"]),
    "torch-compile": ("torch", ["--mode", "torch:compile", "--device", "cuda"]),
    "torch-bf16": ("torch", ["--mode", "torch:eager", "--precision", "bf16", "--device", "cuda"]),
    "torch-tf32": ("torch", ["--mode", "torch:eager", "--precision", "tf32", "--device", "cuda"]),
    "tensorflow": ("tensorflow", ["--device", "gpu"]),
    "jax": ("jax", ["--device", "gpu"]),
    "keras-jax": ("keras-jax", ["--device", "gpu"]),
    "keras-torch": ("keras-torch", ["--device", "cuda"]),
    "cupy": ("numpy", ["--device", "gpu"]),
    "chainer": ("chainer", ["--device", "gpu"]),
    "onnxruntime": ("onnxruntime", ["--device", "cuda"]),
    "tvm": ("tvm", ["--device", "cuda"]),
    "plaidml": ("plaidml", ["--device", "gpu"]),
}
REPORT = "gpu_check.md"


@dataclass
class Outcome:
    path: str
    command: str
    status: str  # ok, unavailable, skipped, or the failure (a results status, or no_result / wrong_device)
    note: str = ""
    parity: Optional[float] = None
    math_mode: str = ""
    version: str = ""
    seconds: Optional[float] = None

    @property
    def clean(self) -> bool:
        """Ok, or not run / not available for a reason that is said."""
        return self.status == "ok" or (self.status in ("skipped", "unavailable") and bool(self.note))


def find_gpu() -> tuple[list[str], str]:
    """(the GPUs nvidia-smi lists, "") or ([], why there is none), without importing a framework."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "no NVIDIA GPU on this machine (nvidia-smi not found)"
    try:
        proc = subprocess.run([exe, "--query-gpu=name,memory.total,compute_cap,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        if proc.returncode:  # a driver too old for compute_cap
            proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"no usable NVIDIA GPU (nvidia-smi did not answer: {exc})"
    gpus = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode or not gpus:
        said = (proc.stderr.strip() or proc.stdout.strip() or "it lists no GPU").splitlines()[-1]
        return [], f"no usable NVIDIA GPU (nvidia-smi: {said})"
    return gpus, ""


def command_of(name: str) -> list[str]:
    backend, args = PATHS[name]
    spec = backends.BACKENDS[backend]
    return ["run", WORKLOAD, "-b", backend, *args, *(["--parity-steps", "5"] if spec.trains else ["--inference-only"])]


def skip_reason(name: str) -> str:
    """Why this path cannot run here, known without running it ("" if it can)."""
    backend, args = PATHS[name]
    try:
        spec = backends.get(backend)
    except BackendUnavailable as exc:
        return str(exc)
    why = backends.problem(spec)
    if why:
        return f"{backend} is not installed here ({why}): {spec.install}"
    device = args[args.index("--device") + 1]
    if device not in spec.devices:
        return f"the {backend} adapter takes --device {', '.join(spec.devices)}, not {device}"
    return ""


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def run_path(name: str, out: Path, timeout: float) -> Outcome:
    """One ``benchbackend run`` in a subprocess of its own session (so a timeout ends its worker too)."""
    argv = command_of(name)
    outcome = Outcome(name, "benchbackend " + " ".join(argv), "no_result")
    csv, log = out / f"{name}.csv", out / f"{name}.log"
    csv.unlink(missing_ok=True)  # a run refused at once (exit 2) must not be judged by an older CSV
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    limit, start = 2 * timeout + 120, time.monotonic()  # the worker's --timeout, plus the parent's own work
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "benchbackend", *argv, *COMMON, "--timeout", f"{timeout:g}",
                                 "-o", str(csv)], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # run writes its rows and exits 143
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            outcome.status, outcome.note = "timeout", f"the run did not end in {limit:g} s; see {log.name}"
            return outcome
    outcome.seconds = time.monotonic() - start
    return judge(outcome, csv, rc, log)


def judge(outcome: Outcome, csv: Path, rc: int, log: Path) -> Outcome:
    """Fill ``outcome`` from the run's CSV (read by ``results.read``) and exit code."""
    try:
        df = results.read(csv)
    except ResultsError:
        outcome.note = f"benchbackend exited {rc} and wrote no results: {last_line(log)}"
        return outcome
    cells = df[df["phase"] == "run"]
    if cells.empty:
        outcome.note = f"no cell ended (benchbackend exited {rc}); see {log.name}"
        return outcome
    outcome.status = results.worst_status(cells["status"])
    outcome.note = next((m for m in cells["message"] if m), "")
    parity = df.loc[df["phase"] == "parity", "parity_max_rel"].dropna()
    outcome.parity = float(parity.max()) if len(parity) else None
    outcome.math_mode = ", ".join(sorted({m for m in df["math_mode"] if m}))
    outcome.version = next((v for v in df["backend_version"] if v), "")
    if outcome.status == "ok":
        devices = sorted(set(cells["device"]))
        if "cpu" in devices:
            outcome.status, outcome.note = "wrong_device", "the cell is ok but ran on cpu, not the GPU"
        elif rc:
            outcome.status, outcome.note = "crashed", f"the cell is ok but benchbackend exited {rc}; see {log.name}"
        else:
            outcome.note = ", ".join(sorted({g for g in df["gpu"] if g}) or devices)
    return outcome


def line_of(o: Outcome) -> str:
    if o.status == "skipped":
        return f"{o.path:<14} skipped: {o.note}"
    parity = f"parity {o.parity:.2e}  " if o.parity is not None else ""
    mode = f"math_mode {o.math_mode}  " if o.math_mode else ""
    took = f"  ({o.seconds:.0f} s)" if o.seconds is not None else ""
    return f"{o.path:<14} {o.status}  {parity}{mode}{o.note}{took}"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def write_report(path: Path, outcomes: list[Outcome], gpus: list[str], no_gpu: str, timeout: float) -> None:
    versions = {}
    for o in outcomes:
        backend = PATHS[o.path][0]
        versions.setdefault(backend, o.version or backends.version(backends.BACKENDS[backend]) or "not installed")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "unavailable", "skipped")}
    failed = sum(not o.clean for o in outcomes)
    lines = [
        "# GPU check", "",
        "- device (name, memory, compute capability, driver): " + ("; ".join(gpus) if gpus else no_gpu),
        f"- host: {platform.node()}, Python {platform.python_version()}, benchbackend {__version__}",
        "- versions: " + ", ".join(f"{b} {v}" for b, v in versions.items()),
        f"- every run also has: `{' '.join(COMMON)} --timeout {timeout:g} -o {path.parent}/PATH.csv`",
        f"- {counts['ok']} ok, {counts['unavailable']} unavailable, {counts['skipped']} skipped, {failed} failed",
        "", "| path | command | status | parity (max rel) | math_mode | note |", "|" + " --- |" * 6,
    ]
    for o in outcomes:
        parity = f"{o.parity:.2e}" if o.parity is not None else ""
        lines.append(f"| {o.path} | `{o.command}` | {o.status} | {parity} | {o.math_mode} | {cell(o.note)} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, help="folder for the report, CSVs and logs "
                                                       "(default: results/gpu-check-<time>/)")
    parser.add_argument("--only", action="append", choices=list(PATHS), metavar="PATH",
                        help=f"run only this path (repeatable): {', '.join(PATHS)}")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="seconds per worker (default 600)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when there is no GPU")
    args = parser.parse_args(argv)
    out = (args.out or Path("results") / time.strftime("gpu-check-%Y%m%dT%H%M%S")).resolve()  # runs start in ROOT
    out.mkdir(parents=True, exist_ok=True)
    gpus, no_gpu = find_gpu()
    print("device: " + ("; ".join(gpus) if gpus else no_gpu), flush=True)
    outcomes = []
    for name in [p for p in PATHS if not args.only or p in args.only]:
        why = no_gpu or skip_reason(name)
        outcome = (Outcome(name, "benchbackend " + " ".join(command_of(name)), "skipped", why) if why
                   else run_path(name, out, args.timeout))
        print(line_of(outcome), flush=True)
        outcomes.append(outcome)
    report = out / REPORT
    write_report(report, outcomes, gpus, no_gpu, args.timeout)
    print(f"report: {report}")
    return 1 if (args.require_gpu and not gpus) or not all(o.clean for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
