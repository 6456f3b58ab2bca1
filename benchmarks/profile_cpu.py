"""Where a CPU cell's steady training time goes, by thread and by native function, from Linux perf.

One worker process (as ``benchmarks/knobs.py`` starts it, with any ``--env`` set) trains the
workload; from the start of epoch 2 to the end of the last epoch it records itself with
``perf record -p <pid>`` (every thread, native frames: XLA's compiled kernels show as JIT code,
Eigen, XNNPACK and oneDNN by their symbols). Prints the steady samples/s and cores kept busy (the
process's CPU time over wall time, as knobs.py measures), the CPU share of each thread name
(``comm``: TensorFlow's and XLA's pools name their threads), and the top functions by self time.
The validation passes between epochs (untimed) fall inside the window too; they are small.

    python benchmarks/profile_cpu.py --backend jax --mode jit --workload cifar10
    python benchmarks/profile_cpu.py --backend tensorflow --mode xla --workload vit-tiny --limit 512
    python benchmarks/profile_cpu.py --backend jax --env XLA_FLAGS=--xla_cpu_use_xnnpack=false

Needs ``perf`` and ``perf_event_paranoid`` at most 2 (user-space samples of one's own process).
This is a figure, not a test.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import knobs  # noqa: E402

from benchbackend.data import arrays  # noqa: E402

#: Run in the worker: perf attaches to this process for the epochs after the first.
PROFILE = """
import signal, subprocess, time
from benchbackend.run import worker as _w
_train = _w._train
def _profiled(cell, *a, **k):
    seen, perf, region = [0], [None], cell.region
    def counted(fn, host=True):
        seen[0] += 1
        if seen[0] == 2:  # epoch 2 begins: attach, outside the clock
            perf[0] = subprocess.Popen(["perf", "record", "-q", "-F", "{freq}", "-p", str(os.getpid()), "-o", "{out}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        return region(fn, host)
    cell.region = counted
    try:
        return _train(cell, *a, **k)
    finally:
        cell.region = region
        if perf[0] is not None:
            perf[0].send_signal(signal.SIGINT)
            perf[0].wait()
_w._train = _profiled
"""


def _report(data: str, sort: str, top: int) -> list[str]:
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", sort, "--stdio", "-q"],
                         capture_output=True, text=True).stdout
    return [line.rstrip() for line in out.splitlines() if line.strip() and "%" in line][:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax")
    parser.add_argument("--mode", default=None, help="default: the backend's first")
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--limit", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=4, help="epoch 1 (compilation) is not profiled")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--freq", type=int, default=499, help="samples per second per thread")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if not shutil.which("perf"):
        sys.exit("perf is not installed (linux-tools)")
    spec = knobs.backends.get(args.backend)
    mode = args.mode or spec.default_mode
    env = dict(e.split("=", 1) for e in args.env)
    w = knobs.sized(args.workload, args.limit, args.epochs, 2)
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "data.npz"), os.path.join(tmp, "perf.data")
        arrays.prepare(w, "synthetic", None, Path(data))
        setting = knobs.Setting("profiled", env=env, threads=args.threads,
                                code=PROFILE.format(freq=args.freq, out=out))
        knob = knobs.Knob("profile", args.backend, mode, "", "", setting, setting)
        rows, status = knobs.run_cell(knob, setting, w, data, 0, 1800.0)
        epochs = [r for r in rows if r.get("phase") == "train_epoch"][1:]
        rate = statistics.median(r["samples_per_s"] for r in epochs) if epochs else None
        cores = statistics.median(r["knob_cores"] for r in epochs) if epochs else None
        print(f"{args.workload} {args.backend}:{mode} {env or ''} threads {args.threads or 'default'}: "
              f"status {status}; "
              f"steady {rate or 0:.0f} samples/s, {cores or 0:.2f} cores busy (CPU time / wall time)")
        if not os.path.exists(out):
            sys.exit("perf recorded nothing (perf_event_paranoid? see the worker's status above)")
        print("\nCPU samples by thread name:")
        print("\n".join(_report(out, "comm", args.top)))
        print("\nCPU samples by library ([JIT]: code XLA compiled; [kernel]: page faults, scheduling):")
        print("\n".join(_report(out, "dso", args.top)))
        print("\nTop functions by self time (all threads):")
        print("\n".join(_report(out, "dso,sym", args.top)))


if __name__ == "__main__":
    main()
