"""What the driver costs per cell at 500, 2,000 and 10,000 cells, on the local executor and on Ray
over a simulated multi-node cluster (issue 25): is it linear?

Each cell is a tiny real one (``tests/support/scale.py``: the NumPy reference on a 4x4 input, a
real worker process), so what a run of thousands measures is the time around the work. For each
executor and cell count it prints:

- wall seconds and cells per second (set by the workers: on this 2-core machine, their start);
- the driver's own CPU seconds per cell (``getrusage`` of this process: placing, streaming,
  checking and writing; the workers, the preloader and the Ray nodes are other processes), the
  figure that says how many cells one driver can feed;
- rows written per second of the driver's CPU time;
- the driver's peak resident memory (it keeps no rows: it should not grow with the cells).

A driver whose cost grew with the cells would show a CPU time per cell that grows down the table.

    python benchmarks/cells_at_scale.py                                  # 500 and 2,000, both executors
    python benchmarks/cells_at_scale.py --cells 10000 --executor local
    python benchmarks/cells_at_scale.py --cells 2000 --executor ray --nodes 4

This is a figure, not a test: nothing here passes or fails (``tests/test_scale.py`` checks the rows).
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import scale  # noqa: E402

from benchbackend import results  # noqa: E402
from benchbackend.run import progress, runner  # noqa: E402


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Count(progress.Display):
    """Counts ended cells and prints one line every ``every`` of them."""

    def __init__(self, total: int, every: int):
        super().__init__()
        self.total, self.every, self.ended = total, every, 0

    def cell_ended(self, cell, status: str) -> None:
        super().cell_ended(cell, status)
        self.ended += 1
        if self.ended % self.every == 0:
            print(f"    {self.ended:,}/{self.total:,} cells", file=sys.stderr, flush=True)


def measure(executor_name: str, cells: int, nodes: int, folder: Path) -> dict[str, float]:
    from benchbackend.run.executors.local import LocalExecutor

    out = folder / f"{executor_name}-{cells}.csv"
    plan = scale.plan(folder, cells)
    if executor_name == "ray":
        from benchbackend.run.executors.ray import RayExecutor

        executor = RayExecutor()
    else:
        executor = LocalExecutor()
    run = runner.Runner(plan, executor, results.CsvWriter(out), _Count(cells, max(cells // 10, 1)))
    cpu, start = _cpu(), time.perf_counter()
    ended = run.run()
    wall, cpu = time.perf_counter() - start, _cpu() - cpu
    rows = run.writer.rows
    bad = [c.status for c in ended if c.status != "ok"]
    if len(ended) != cells or bad:
        print(f"    warning: {len(ended)} cells ended, {len(bad)} not ok ({sorted(set(bad))})", file=sys.stderr)
    return {"wall": wall, "cpu": cpu, "rows": rows, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, action="append", help="cell counts (repeatable; multiples of 4)")
    parser.add_argument("--executor", action="append", choices=["local", "ray"], help="(repeatable) default: both")
    parser.add_argument("--nodes", type=int, default=4, help="simulated Ray nodes (processes on this machine)")
    args = parser.parse_args()
    print(f"{'executor':>8} {'cells':>7} {'rows':>8} {'wall s':>8} {'cells/s':>8} {'driver cpu s':>12} "
          f"{'cpu ms/cell':>11} {'rows/cpu s':>10} {'peak MB':>8}")
    for name in args.executor or ["local", "ray"]:
        context = scale.simulated_cluster(args.nodes) if name == "ray" else contextlib.nullcontext()
        with context, tempfile.TemporaryDirectory() as tmp:
            for cells in args.cells or [500, 2000]:
                m = measure(name, cells, args.nodes, Path(tmp))
                print(f"{name:>8} {cells:>7,} {m['rows']:>8,} {m['wall']:>8.1f} {cells / m['wall']:>8.1f} "
                      f"{m['cpu']:>12.1f} {1000 * m['cpu'] / cells:>11.2f} {m['rows'] / m['cpu']:>10,.0f} "
                      f"{m['rss_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
