"""The results writer's cost per cell: is it linear in the rows? (issue 25: 10,000 cells x 20 rows in under 30 s)

For each cell count, writes that many cells of ``--rows`` rows each with the real
``results.CsvWriter`` as the runner does (each row appended as ``pending`` the moment it arrives,
then the cell's ``run`` row with its final status), then ``close()`` (the one rewrite that gives
every row its final status), and prints the seconds, the seconds per cell and the rows per second.
A writer whose cost grew with the file would show a per-cell time that grows with the cells.

    python benchmarks/writer_speed.py                          # 500, 2,000 and 10,000 cells
    python benchmarks/writer_speed.py --cells 1000 --rows 40

This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend import results  # noqa: E402

ENV = {"host": "node-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}


def write(path: Path, cells: int, rows: int) -> tuple[float, float]:
    """(seconds appending, seconds of the final rewrite) for ``cells`` cells of ``rows`` rows."""
    writer = results.CsvWriter(path)
    start = time.perf_counter()
    for order in range(cells):
        base = dict(ENV, run_id="bench", cell_order=order, workload="mnist", workload_hash="abc123",
                    backend="numpy", mode="reference", precision="fp32", device="cpu", repeat=order % 5 + 1,
                    data_source="synthetic")
        for i in range(rows - 1):
            phase = "train_epoch" if i < rows // 2 else "inference"
            writer.write({**base, "phase": phase, "epoch": i + 1 if phase == "train_epoch" else None,
                          "pass": i + 1 if phase == "inference" else None, "seconds": 1.0 + i * 1e-3,
                          "samples": 50000, "samples_per_s": 50000 / (1.0 + i * 1e-3), "loss": 0.5})
        writer.end_cell(base, "ok")
    appended = time.perf_counter() - start
    start = time.perf_counter()
    writer.close()
    return appended, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, action="append", help="cell counts (repeatable)")
    parser.add_argument("--rows", type=int, default=20, help="rows per cell, its run row included")
    args = parser.parse_args()
    print(f"{'cells':>7} {'rows':>8} {'append s':>9} {'close s':>8} {'total s':>8} {'ms/cell':>8} {'rows/s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for cells in args.cells or [500, 2000, 10000]:
            path = Path(tmp) / f"w{cells}.csv"
            appended, closed = write(path, cells, args.rows)
            total, n = appended + closed, cells * args.rows
            print(f"{cells:>7,} {n:>8,} {appended:>9.2f} {closed:>8.2f} {total:>8.2f} {1000 * total / cells:>8.2f} "
                  f"{n / total:>8,.0f}")


if __name__ == "__main__":
    main()
