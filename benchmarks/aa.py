"""A/A: one backend against itself, to prove the noise floor of compare's verdicts (issue 35).

One cell is repeated 6 x TRIALS times in fresh worker processes, by the real CLI. Its repeats are
named alternately A and B (so the two "choices" are interleaved, A B A B, as a run interleaves two
backends) and cut into trials of 3 repeats a side; each trial is one experiment that ``compare``
judges with its own rule, B against A. Nothing differs between A and B, so every ``faster`` or
``slower`` is a false verdict: on a quiet machine at most 5% of the trials may give one. With
``--hog N``, N processes spin on the cores for the whole run: the verdicts must then be withheld
(``no verdict (machine busy)``), not wrong.

    python benchmarks/aa.py --backend torch --trials 20
    python benchmarks/aa.py --backend torch --trials 5 --hog 2

This is what regression detectors are judged by (pytorch/benchmark#1519, optimum-benchmark#166).
Timing figures belong here, never in the tests' pass/fail thresholds.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pandas as pd

from benchbackend import results
from benchbackend.analysis import compare, experiments

SIDE = 3  # repeats a side in one trial


def _run(args: argparse.Namespace, out: Path) -> float:
    """The cell, repeated 2 x SIDE x trials times (with the hogs running, if asked); its wall seconds."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    cmd = [sys.executable, "-m", "benchbackend", "run", args.workload, "-b", args.backend, "--data", "synthetic",
           "--limit", str(args.limit), "--epochs", str(args.epochs), "--repeats", str(2 * SIDE * args.trials),
           "--no-plots", "-q", "-o", str(out)]
    if args.inference_only:
        cmd.append("--inference-only")
    start = time.perf_counter()
    try:
        got = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if not out.exists():
        sys.exit(f"the run wrote nothing: {got.stderr[-2000:]}")
    return time.perf_counter() - start


def trials(df: pd.DataFrame) -> pd.DataFrame:
    """The rows as trials: repeat r of the run is trial (r - 1) // 6, side A or B by its parity, and
    repeat 1..3 of that side; each trial is a workload of its own, so compare judges it alone."""
    df = df.copy()
    r = df["repeat"].astype(int) - 1
    df["workload"] = "trial" + (r // (2 * SIDE) + 1).astype(str).str.zfill(3)
    df["workload_hash"] = df["workload"]  # one definition per trial
    df["backend"] = (r % 2).map({0: "A", 1: "B"})
    df["repeat"] = (r % (2 * SIDE)) // 2 + 1
    return df


def verdicts(path: Path) -> pd.DataFrame:
    """B's verdict against A in each trial, for training and inference."""
    df = experiments.for_comparison(trials(results.read(path)))
    outcome = compare.compare_frame(df, baseline="A")
    b = outcome.groups.xs("B", level="backend")
    return pd.DataFrame({"train": b["train_verdict"].to_numpy(), "infer": b["infer_verdict"].to_numpy(),
                         "train_text": b["train_text"].to_numpy(), "infer_text": b["infer_text"].to_numpy()})


def report(table: pd.DataFrame, shares: pd.Series, seconds: float, args: argparse.Namespace) -> str:
    lines = [f"A/A: {args.backend} on {args.workload} (--limit {args.limit}, --epochs {args.epochs}"
             f"{', --inference-only' if args.inference_only else ''}), {len(table)} trials of {SIDE} repeats a side, "
             f"{'with ' + str(args.hog) + ' CPU hog(s)' if args.hog else 'no planted hog'}; {seconds:.0f} s",
             f"foreign_cpu_share of the timed rows: median {shares.median():.1%}, max {shares.max():.1%}"]
    for col in ("train", "infer"):
        counts = Counter(table[col])
        if set(counts) <= {"n/a"}:
            continue
        wrong = counts.get("faster", 0) + counts.get("slower", 0)
        judged = sum(counts.values())
        lines.append(f"{col}: {wrong}/{judged} false verdicts ({wrong / judged:.0%}); "
                     + ", ".join(f"{v} {n}" for v, n in counts.most_common()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--workload", default="mnist")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--limit", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--inference-only", action="store_true")
    ap.add_argument("--hog", type=int, default=0, metavar="N", help="N spinning processes beside the run")
    ap.add_argument("--csv", type=Path, help="judge this file of an earlier aa.py run instead of running")
    args = ap.parse_args()
    if args.csv is not None:
        path, seconds = args.csv, float("nan")
    else:
        path = Path(tempfile.mkdtemp(prefix="aa-")) / "aa.csv"
        seconds = _run(args, path)
    df = results.read(path)
    shares = df.loc[df["phase"].isin(["train_epoch", "inference"]), "foreign_cpu_share"]
    print(report(verdicts(path), shares, seconds, args))
    print(f"rows: {path}")


if __name__ == "__main__":
    main()
