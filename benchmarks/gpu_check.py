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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    # Beyond mnist (issue 42): attention's fused kernel, bf16 convolutions, and a GPU that is not there.
    "torch-sdpa-vit": ("torch", ["--mode", "torch:sdpa", "--device", "cuda"]),
    "torch-bf16-resnet8": ("torch", ["--mode", "torch:eager", "--precision", "bf16", "--device", "cuda"]),
    "torch-cuda1": ("torch", ["--mode", "torch:eager", "--device", "cuda:1"]),
    "torch-nccl-2": ("torch", ["--mode", "torch:eager", "--replicas", "2", "--device", "cuda"]),
}
#: Paths that need more than one GPU: skipped, with the count, where nvidia-smi lists fewer.
MIN_GPUS = {"torch-nccl-2": 2}
#: The paths that run another workload than mnist.
WORKLOAD_OF = {"torch-sdpa-vit": "vit-tiny", "torch-bf16-resnet8": "resnet8"}
#: A path whose device may be absent: on a machine without it, the run must refuse it cleanly (a cell
#: ``unavailable``, or exit 2 with one line, no traceback) and name it.
MAY_BE_ABSENT = {"torch-cuda1": "cuda:1"}
#: ``--mfu``: after the paths, alone on the GPU, torch eager trains each workload in each precision.
MFU_WORKLOADS = ("resnet20", "vit-tiny")
MFU_PRECISIONS = ("fp32", "tf32", "bf16")
MFU_SIZE = ["--data", "synthetic", "--limit", "8192", "--epochs", "3", "--repeats", "1", "--parity-steps", "5"]
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
    on_device: str = ""  # the placement rule's decision (data_on_device), per the cell's rows

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


def command_of(name: str, cpu: bool = False) -> list[str]:
    backend, args = PATHS[name]
    if cpu:  # the rehearsal: the same run on the CPU
        args = [a if i == 0 or args[i - 1] != "--device" else "cpu" for i, a in enumerate(args)]
    spec = backends.BACKENDS[backend]
    return ["run", WORKLOAD_OF.get(name, WORKLOAD), "-b", backend, *args,
            *(["--parity-steps", "5"] if spec.trains else ["--inference-only"])]


def skip_reason(name: str, cpu: bool = False, gpus: int = 1) -> str:
    """Why this path cannot run here, known without running it ("" if it can)."""
    backend, args = PATHS[name]
    if not cpu and gpus < MIN_GPUS.get(name, 1):
        return f"needs {MIN_GPUS[name]} GPUs; nvidia-smi lists {gpus}"
    if cpu:
        args = ["--device", "cpu"]
    try:
        spec = backends.get(backend)
    except BackendUnavailable as exc:
        return str(exc)
    why = backends.problem(spec)
    if why:
        return f"{why if why.startswith(backend) else f'{backend}: {why}'} here: {spec.install}"
    device = args[args.index("--device") + 1]
    if not spec.accepts(device):
        return f"the {backend} adapter takes --device {', '.join(spec.devices)}, not {device}"
    return ""


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def benchbackend(argv: list[str], csv: Path, log: Path, timeout: float,
                 cache: Optional[Path] = None) -> tuple[Optional[int], float]:
    """One ``benchbackend run`` in a subprocess of its own session (so a timeout ends its worker
    too): (its exit code or None when it did not end in time, its seconds). ``cache``: its
    ``BENCHBACKEND_CACHE`` (GEMM peaks, reference trajectories) instead of the user's."""
    csv.unlink(missing_ok=True)  # a run refused at once (exit 2) must not be judged by an older CSV
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **({"BENCHBACKEND_CACHE": str(cache)} if cache else {})}
    limit, start = 2 * timeout + 120, time.monotonic()  # the worker's --timeout, plus the parent's own work
    common = COMMON if "--limit" not in argv else ["--no-plots", "-q", "--force"]
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "benchbackend", *argv, *common, "--timeout", f"{timeout:g}",
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
            return None, time.monotonic() - start
    return rc, time.monotonic() - start


def run_path(name: str, out: Path, timeout: float, cpu: bool = False) -> Outcome:
    argv = command_of(name, cpu)
    outcome = Outcome(name, "benchbackend " + " ".join(argv), "no_result")
    csv, log = out / f"{name}.csv", out / f"{name}.log"
    rc, outcome.seconds = benchbackend(argv, csv, log, timeout)
    if rc is None:
        outcome.status, outcome.note = "timeout", f"the run did not end in {outcome.seconds:.0f} s; see {log.name}"
        return outcome
    outcome = judge(outcome, csv, rc, log, cpu)
    absent = MAY_BE_ABSENT.get(name)
    if absent and outcome.status == "no_result" and rc == 2:  # refused before any cell: one line, no traceback
        said = last_line(log)
        if absent in said and "Traceback" not in log.read_text(errors="replace"):
            outcome.status, outcome.note = "unavailable", said
    return outcome


def distinct(column) -> str:
    """A CSV column's distinct non-empty values, sorted and joined: ``ieee, tf32``, ``True``."""
    return ", ".join(sorted({str(v) for v in column.dropna() if str(v)}))


def judge(outcome: Outcome, csv: Path, rc: int, log: Path, cpu: bool = False) -> Outcome:
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
    outcome.math_mode = distinct(df["math_mode"])
    outcome.version = next((v for v in df["backend_version"] if v), "")
    outcome.on_device = distinct(df["data_on_device"])
    if outcome.status == "ok":
        devices = sorted(set(cells["device"]))
        if "cpu" in devices and not cpu:
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


class GpuMemory:
    """The most memory ``nvidia-smi`` saw held by compute processes while it ran (polled twice a
    second in a thread): the driver's view of a cell, CUDA context and the caching allocator's
    reserve included, to read beside ``peak_device_mb`` (torch's own ``max_memory_allocated``)."""

    def __init__(self) -> None:
        self.peak_mib: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        exe = shutil.which("nvidia-smi")
        while exe and not self._stop.wait(0.5):
            try:
                out = subprocess.run([exe, "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            used = [float(x) for x in out.split() if x.replace(".", "", 1).isdigit()]
            if used:
                self.peak_mib = max(self.peak_mib or 0.0, max(used))

    def __enter__(self) -> "GpuMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def mfu_command(workload: str, cpu: bool) -> list[str]:
    device = "cpu" if cpu else "cuda"
    precisions = [p for p in MFU_PRECISIONS if not (cpu and p == "tf32")]
    return ["run", workload, "-b", "torch", "--mode", "torch:eager", "--device", device,
            *[a for p in precisions for a in ("--precision", p)], *MFU_SIZE]


def measure_mfu(out: Path, timeout: float, cpu: bool) -> list[str]:
    """``--mfu``: torch eager trains each MFU workload in each precision, alone on the GPU; the
    markdown lines of what it measured (the timed epochs' medians; the first epoch is set apart).
    Its GEMM peaks are probed afresh, alone, in a cache of its own (``OUT/mfu-cache``): the paths'
    runs may have shared the GPU (``--jobs``), and a probe taken beside them reads low."""
    cache = out / "mfu-cache"
    shutil.rmtree(cache, ignore_errors=True)
    commands: list[str] = []
    lines = ["", "| workload | precision | status | train samples/s | MFU | peak (TFLOP/s) | peak source | "
             "parity (max rel) | math_mode | data_on_device | peak_device_mb (torch) | nvidia-smi MiB (process) |",
             "|" + " --- |" * 12]
    for workload in MFU_WORKLOADS:
        argv = mfu_command(workload, cpu)
        csv, log = out / f"mfu-{workload}.csv", out / f"mfu-{workload}.log"
        with GpuMemory() as smi:
            rc, seconds = benchbackend(argv, csv, log, timeout, cache)
        print(f"mfu {workload}: benchbackend exited {rc} in {seconds:.0f} s", flush=True)
        commands.append(f"- `benchbackend {' '.join(argv)}` (exit {rc}, {seconds:.0f} s)")
        try:
            df = results.read(csv)
        except ResultsError:
            lines.append(f"| {workload} | | no results | | | | | | | | | {cell(last_line(log))} |")
            continue
        for precision, rows in df.groupby("precision", sort=False):
            timed = rows[(rows["phase"] == "train_epoch") & (rows["epoch"] > 1)]
            status = results.worst_status(rows.loc[rows["phase"] == "run", "status"]) if (
                rows["phase"] == "run").any() else "no_run_row"
            parity = rows.loc[rows["phase"] == "parity", "parity_max_rel"].iloc[:1].dropna()  # the forward row
            peak = rows["peak_flops"].dropna()

            def num(series, fmt: str) -> str:
                series = series.dropna()
                return format(float(series.median()), fmt) if len(series) else ""
            lines.append(" | ".join([
                f"| {workload}", str(precision), status, num(timed["samples_per_s"], ".0f"), num(timed["mfu"], ".3f"),
                format(float(peak.max()) / 1e12, ".1f") if len(peak) else "",
                cell(distinct(rows["peak_source"])),
                format(float(parity.max()), ".2e") if len(parity) else "",
                distinct(rows["math_mode"]), distinct(rows["data_on_device"]),
                num(rows["peak_device_mb"].dropna().iloc[-1:], ".0f"),
                "" if smi.peak_mib is None else f"{smi.peak_mib:.0f} (whole run)"]) + " |")
    return ["", "## MFU: torch eager, one command per workload, alone on the device", "", *commands, *lines]


def write_report(path: Path, outcomes: list[Outcome], gpus: list[str], no_gpu: str, timeout: float,
                 extra: Optional[list[str]] = None) -> None:
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
        "", "| path | command | status | parity (max rel) | math_mode | data_on_device | note |", "|" + " --- |" * 7,
    ]
    for o in outcomes:
        parity = f"{o.parity:.2e}" if o.parity is not None else ""
        lines.append(f"| {o.path} | `{o.command}` | {o.status} | {parity} | {o.math_mode} | {o.on_device} "
                     f"| {cell(o.note)} |")
    path.write_text("\n".join(lines + (extra or [])) + "\n")


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
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run N paths at once (default 1; each is its own process, sharing the GPU)")
    parser.add_argument("--mfu", action="store_true",
                        help=f"then, alone on the GPU, train {' and '.join(MFU_WORKLOADS)} on torch eager in "
                             f"{', '.join(MFU_PRECISIONS)}: MFU, the GEMM peak, memory (a table in the report)")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse on the CPU: every run's --device becomes cpu (checks this script, not a GPU)")
    args = parser.parse_args(argv)
    out = (args.out or Path("results") / time.strftime("gpu-check-%Y%m%dT%H%M%S")).resolve()  # runs start in ROOT
    out.mkdir(parents=True, exist_ok=True)
    gpus, no_gpu = find_gpu()
    if args.cpu:
        gpus, no_gpu = ["cpu (a rehearsal: --cpu)"], ""
    print("device: " + ("; ".join(gpus) if gpus else no_gpu), flush=True)
    names = [p for p in PATHS if not args.only or p in args.only]

    def one(name: str) -> Outcome:
        why = no_gpu or skip_reason(name, args.cpu, len(gpus))
        outcome = (Outcome(name, "benchbackend " + " ".join(command_of(name, args.cpu)), "skipped", why) if why
                   else run_path(name, out, args.timeout, args.cpu))
        print(line_of(outcome), flush=True)
        return outcome
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = list(pool.map(one, names))
    report = out / REPORT
    write_report(report, outcomes, gpus, no_gpu, args.timeout)  # now, in case the MFU runs are cut short
    if args.mfu and not no_gpu:
        write_report(report, outcomes, gpus, no_gpu, args.timeout, measure_mfu(out, args.timeout, args.cpu))
    print(f"report: {report}")
    return 1 if (args.require_gpu and not gpus) or not all(o.clean for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
