"""Speed of ``compare``: time ``run_compare`` over a generated results CSV (target: 100,000 rows < 2 s).

Writes the CSV with the real ``results.CsvWriter`` (2 workloads x 4 backends x 10 repeats, each
repeat 40 epochs and 10 inference passes, until ``--rows`` rows), then times:

* cold: the first ``run_compare`` in this process (pandas' first calls: its parser, its groupby);
* warm: the best of ``--runs`` further calls, split into reading (``results.read_many``) and the rest;
* process: ``python -m benchbackend compare FILE`` from start to exit (the median of ``--runs``),
  as a user of ``benchbackend compare`` feels it (the console script exits the same way).

    python benchmarks/compare_speed.py                 # 100,000 rows
    python benchmarks/compare_speed.py --rows 20000 --keep /tmp/rows.csv

This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend import results  # noqa: E402

BACKENDS = {"numpy": 2.0, "torch": 1.0, "tensorflow": 1.2, "plaidml": 1.5}
ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}


def generate(path: Path, rows: int, seed: int = 0) -> int:
    """Write at least ``rows`` realistic rows; return how many were written."""
    rng = np.random.default_rng(seed)
    writer = results.CsvWriter(path)
    n, run = 0, 0
    while n < rows:
        run += 1
        for workload in ("mnist", "cifar10"):
            for backend, steady in BACKENDS.items():
                for rep in range(1, 11):
                    base = dict(ENV, run_id=f"run{run}", workload=workload, workload_hash=f"{workload}-h",
                                backend=backend, backend_version="1.0", device="cpu", repeat=rep, status="ok")
                    writer.write(dict(base, phase="parity", epoch=0, seconds=0.01, parity_max_abs=1e-7))
                    for epoch in range(1, 41):
                        seconds = float(steady * (3 if epoch == 1 else 1) * (1 + 0.03 * rng.standard_normal()))
                        writer.write(dict(base, phase="train_epoch", epoch=epoch, samples=50000, seconds=seconds,
                                          samples_per_s=50000 / seconds, loss=2.0 / epoch, accuracy=0.9,
                                          val_loss=2.0 / epoch, val_accuracy=0.9))
                    for p in range(1, 11):
                        writer.write(dict(base, phase="inference", epoch=p, samples=10000,
                                          seconds=float(steady / 4 * (1 + 0.03 * rng.standard_normal()))))
                    n += 51
                    if n >= rows:
                        return n
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3, help="warm calls to time (best is reported)")
    parser.add_argument("--keep", type=Path, help="write the CSV here (and reuse it if it exists)")
    args = parser.parse_args()

    path = args.keep or Path(tempfile.mkdtemp()) / "rows.csv"
    if not path.exists():
        t = time.perf_counter()
        written = generate(path, args.rows)
        print(f"generated {written:,} rows in {time.perf_counter() - t:.1f} s: {path}")
    rows = sum(1 for _ in open(path)) - 1

    from benchbackend.analysis import compare

    t = time.perf_counter()
    out = compare.run_compare([str(path)])
    cold = time.perf_counter() - t
    warm, read = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        results.read_many([str(path)])
        read.append(time.perf_counter() - t)
        t = time.perf_counter()
        compare.run_compare([str(path)])
        warm.append(time.perf_counter() - t)
    spans = []
    for _ in range(args.runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchbackend", "compare", str(path)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        spans.append(time.perf_counter() - t)
    process = float(np.median(spans))

    print(out.text.splitlines()[0])
    print(f"rows: {rows:,}")
    print(f"run_compare, first call in the process: {cold:.2f} s")
    print(f"run_compare, warm (best of {args.runs}): {min(warm):.2f} s "
          f"(reading and validating: {min(read):.2f} s, the rest: {min(warm) - min(read):.2f} s)")
    print(f"whole process (interpreter, imports, compare; median of {args.runs}): {process:.2f} s")


if __name__ == "__main__":
    main()
