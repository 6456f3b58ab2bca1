"""Chainer define-by-run against static-graph on MNIST: steady s/epoch, their ratio, validation accuracy.

Runs the product itself (needs ``benchbackend setup chainer`` first), then summarizes its CSV:

    python benchmarks/chainer_static_graph.py                         # full mnist, 5 epochs, 3 repeats
    python benchmarks/chainer_static_graph.py --limit 8192 --epochs 3 --repeats 5
    python benchmarks/chainer_static_graph.py --csv results/chainer.csv   # summarize an earlier run

Steady s/epoch is the median over repeats of each repeat's median epoch time from epoch 2 on
(epoch 1 holds static_graph's tracing). ``benchbackend compare CSV --baseline chainer:define-by-run``
gives the same comparison with confidence intervals and a significance verdict. A figure, not a test.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend import results  # noqa: E402

MODES = ("define-by-run", "static-graph")


def run(csv: Path, workload: str, epochs: int, repeats: int, limit: int | None, data: str) -> int:
    cmd = [sys.executable, "-m", "benchbackend", "run", workload, "-b", "chainer",
           *[a for m in MODES for a in ("--mode", f"chainer:{m}")], "--epochs", str(epochs),
           "--repeats", str(repeats), "--data", data, "-o", str(csv), "--no-plots"]
    if limit:
        cmd += ["--limit", str(limit)]
    print("$", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=ROOT).returncode


def summarize(csv: Path) -> list[str]:
    df = results.read(csv)
    df = df[(df.backend == "chainer") & (df.phase == "train_epoch")]
    lines, steady = [], {}
    for mode in MODES:
        rows = df[(df["mode"] == mode) & (df.status == "ok")]
        if rows.empty:
            lines.append(f"{mode:>14}: no ok epochs in {csv}")
            continue
        later = rows[rows.epoch >= 2] if (rows.epoch >= 2).any() else rows
        steady[mode] = float(later.groupby("repeat")["seconds"].median().median())
        last = rows[rows.epoch == rows.epoch.max()]
        lines.append(f"{mode:>14}: steady {steady[mode]:.3f} s/epoch over {rows.repeat.nunique()} repeats; "
                     f"first epoch {rows[rows.epoch == 1]['seconds'].median():.3f} s; "
                     f"validation accuracy {last['val_accuracy'].median():.4f}")
    if len(steady) == 2:
        ratio = steady["define-by-run"] / steady["static-graph"]
        lines.append(f"define-by-run vs static-graph: static-graph is {ratio:.2f}x "
                     f"{'faster' if ratio >= 1 else 'slower'} per steady epoch (confidence interval: "
                     f"`benchbackend compare {csv} --baseline chainer:define-by-run`)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, help="summarize this results CSV instead of running")
    ap.add_argument("--workload", default="mnist")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, help="training samples (default: the workload's)")
    ap.add_argument("--data", default="synthetic", choices=["synthetic", "real", "auto"],
                    help="as `run --data` (default synthetic: no download)")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "results" / "chainer-static-graph.csv")
    args = ap.parse_args()
    csv = args.csv
    if csv is None:
        csv = args.output
        csv.parent.mkdir(parents=True, exist_ok=True)
        code = run(csv, args.workload, args.epochs, args.repeats, args.limit, args.data)
        if not csv.is_file():
            return code or 1
    print("\n".join(summarize(csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
