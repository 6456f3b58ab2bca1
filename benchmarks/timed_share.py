"""How much of a run's wall time is timed (epochs and inference passes), and where the rest goes.

Runs ``benchbackend run`` with the arguments given (default: the README's quick start), stamps
each progress line as it arrives, and prints:

- the wall time, the timed seconds (``train_epoch`` and ``inference`` rows of the CSV) and their share;
- per backend and stage, the mean seconds per cell, from each progress line to the next one of the same cell:
  ``start`` (worker process start and framework import, to the version line), ``build`` (data,
  weights, compile), ``peak``, ``parity`` (reference forward, training-mode parity), ``epoch N``
  (timed epoch plus its untimed validation), ``inference`` (the timed passes), ``end`` (the last
  line to the cell's verdict) and ``between`` (the parent: verdict to the next worker's start).

Usage (nothing else running; two cores are shared by everything)::

    python benchmarks/timed_share.py
    python benchmarks/timed_share.py mnist -b torch --data synthetic --limit 2000 --epochs 2 --repeats 3
"""
from __future__ import annotations

import csv
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

QUICK_START = ["mnist", "cifar10", "-b", "torch", "-b", "tensorflow", "--data", "synthetic", "--limit", "2000",
               "--epochs", "2", "--repeats", "3"]
TAG = re.compile(r"^\[(?P<cell>[^\]]+ r\d+/\d+)\] (?P<text>.*)$")


def stage(text: str) -> str | None:
    """The stage a progress line ends, or None for lines that end none (heartbeats, notes)."""
    if text.startswith("starting worker"):
        return "between"
    if " on " in text and "(" in text and text.split()[1][0].isdigit():
        return "start"  # "torch 2.13.0+cpu on cpu (2 threads)"
    for prefix, name in (("built", "build"), ("peak", "peak"), ("parity", "parity"), ("trajectory", "parity"),
                         ("inference", "inference"), ("ok", "end"), ("epoch", "epoch")):
        if text.startswith(prefix):
            return name
    return None


def main(args: list[str]) -> None:
    args = args or QUICK_START
    csv_path = Path(tempfile.mkdtemp()) / "share.csv"
    cmd = [sys.executable, "-m", "benchbackend", "run", *args, "-o", str(csv_path)]
    started = time.monotonic()
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))
    wall = time.monotonic() - started
    if proc.returncode:
        print("\n".join(text for _, text in lines[-20:]))
        raise SystemExit(f"run exited {proc.returncode}")
    rows = list(csv.DictReader(csv_path.open()))
    timed = sum(float(r["seconds"]) for r in rows if r["phase"] in ("train_epoch", "inference") and r["seconds"])
    stages: dict[tuple[str, str], list[float]] = defaultdict(list)
    last: dict[str, float] = {}
    previous_end = None
    for t, line in lines:
        match = TAG.match(line)
        if not match:
            continue
        cell, text = match["cell"], match["text"]
        backend = cell.split("/")[1].split(":")[0]
        name = stage(text)
        if name is None:
            continue
        if name == "between":
            if previous_end is not None:
                stages[backend, "between"].append(t - previous_end)
            last[cell] = t
            continue
        if cell in last:
            stages[backend, name].append(t - last[cell])
        last[cell] = t
        if name == "end":
            previous_end = t
    cells = sum(len(v) for (_, name), v in stages.items() if name == "end") or 1
    print(f"command: benchbackend run {' '.join(args)}")
    print(f"wall {wall:.1f} s, timed {timed:.1f} s: {100 * timed / wall:.1f}% timed; {cells} cells, "
          f"{(wall - timed) / cells:.2f} s a cell outside the clock")
    print(f"{'backend':<12} {'stage':<10} {'cells':>5} {'per cell s':>10} {'total s':>8}")
    for (backend, name), values in sorted(stages.items()):
        print(f"{backend:<12} {name:<10} {len(values):>5} {sum(values) / len(values):>10.2f} {sum(values):>8.1f}")
    print(f"outside the cells (the parent's start, summary, plots): {wall - sum(map(sum, stages.values())):.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
