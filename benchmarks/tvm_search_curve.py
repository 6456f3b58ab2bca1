"""tvm:tuned's search curve: time per inference pass against the trial budget, beside tvm:default and
ONNX Runtime, from the CLI's own runs.

For each budget, one ``benchbackend run WORKLOAD -b tvm -b onnxruntime --mode tvm:default --mode
tvm:tuned --mode onnxruntime:default --inference-only --tune-trials N`` (interleaved repeats, each in a
fresh worker), into its own CSV. The first tuned repeat searches (cold), the next ones reuse the
database (warm: the ``tune`` row's notes say ``reused database``). Prints one line per budget:
the search's seconds, the tasks searched and the searched schedules kept, how many tuned repeats
reused the database (all but the first on a cold cache, all on a warm one), and the median time per
pass of each mode (median of the passes after the first, then the median over repeats, as ``run``'s
summary).

    python benchmarks/tvm_search_curve.py --workload cifar10 --trials 16 --trials 64 --trials 200
    python benchmarks/tvm_search_curve.py --workload resnet20 --trials 64 --cache /tmp/tvm-cache

``--cache`` (``BENCHBACKEND_CACHE`` of the runs): a fresh folder makes every first search cold.
This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def per_pass(rows: list[dict[str, str]]) -> dict[str, float]:
    """Median seconds per pass of each backend:mode (passes after the first, then over repeats)."""
    passes: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r["phase"] == "inference" and r["seconds"]:
            passes[(f"{r['backend']}:{r['mode']}", r["repeat"])].append((int(r["pass"]), float(r["seconds"])))
    by_mode: dict[str, list[float]] = defaultdict(list)
    for (mode, _), times in passes.items():
        later = [s for p, s in sorted(times)[1:]] or [s for _, s in times]
        by_mode[mode].append(statistics.median(later))
    return {mode: statistics.median(v) for mode, v in by_mode.items()}


def tune_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return sorted((r for r in rows if r["phase"] == "tune"), key=lambda r: int(r["repeat"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--trials", type=int, action="append", help="budgets (repeatable; default 16, 64, 200)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, help="test samples per pass (default: the workload's)")
    parser.add_argument("--cache", type=Path, help="BENCHBACKEND_CACHE for the runs (default: a fresh one)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the CSVs")
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="tvm-cache-"))
    env = {**os.environ, "BENCHBACKEND_CACHE": str(cache)}
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"cache: {cache}")
    print(f"{'trials':>6}  {'search s':>8}  {'kept/searched':>13}  {'reused':>6}  {'default s':>9}  {'tuned s':>8}  "
          f"{'onnxruntime s':>13}  tuned executable")
    for trials in args.trials or [16, 64, 200]:
        out = args.out / f"tvm-curve-{args.workload}-t{trials}.csv"
        cmd = [sys.executable, "-m", "benchbackend", "run", args.workload, "-b", "tvm", "-b", "onnxruntime",
               "--mode", "tvm:default", "--mode", "tvm:tuned", "--mode", "onnxruntime:default", "--inference-only",
               "--data", "synthetic", "--repeats", str(args.repeats), "--tune-trials", str(trials),
               "-o", str(out), "--force", "--no-plots", "-q", *(["--limit", str(args.limit)] if args.limit else [])]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = list(csv.DictReader(out.open()))
        times, tunes = per_pass(rows), tune_rows(rows)
        summary = next(cache.glob(f"tvm/{args.workload}-*-t{trials}/summary.json"))
        summary = json.loads(summary.read_text())  # the search's own figures, also when this run reused it
        per_task = summary["per_task"]
        searched = [t for t in per_task if t["trials"]]
        kept = sum(t["chosen"] == "searched" for t in searched)
        reused = sum(r["notes"].startswith("reused database") for r in tunes)
        kept_exe = {m.group(1) for r in tunes for m in [re.search(r"(\w+) executable kept", r["notes"])] if m}
        executable = "; ".join(sorted(kept_exe or {"default (no searched schedule kept)"}))
        print(f"{trials:>6}  {summary['seconds']:>8.1f}  {f'{kept}/{len(searched)}':>13}  "
              f"{f'{reused}/{len(tunes)}':>6}  {times['tvm:default']:>9.3f}  {times['tvm:tuned']:>8.3f}  "
              f"{times['onnxruntime:default']:>13.3f}  {executable}")
        for t in searched:
            d, s = t["duel_default_s"], t["duel_searched_s"]
            print(f"        {t['name']:<28} share {t['share']:.0%} trials {t['trials']:>3}: "
                  f"default {d * 1e3:.3f} ms, searched {s * 1e3:.3f} ms -> {t['chosen']}" if d and s else
                  f"        {t['name']:<28} share {t['share']:.0%} trials {t['trials']:>3}: no searched schedule")


if __name__ == "__main__":
    main()
