"""Every backend at its best: samples/s and MFU of each torch and tensorflow mode x precision.

Each cell runs in a fresh worker process (``python -m benchbackend.run.worker``, as ``run`` starts
it) on the same synthetic data: a few training epochs (the first holds compilation and is left
out), then timed inference passes (the first left out). Prints the median steady samples/s and
the MFU: achieved FLOP/s over the GEMM peak of that precision on this machine (the best that
either framework's ``gemm_peak`` probe reaches, measured first, each in its own process).

FLOPs: ``model.flops_per_sample`` is the *forward* count (a multiply-add counted as 2); a
training sample costs ``results.TRAIN_FLOPS_FACTOR`` forward passes (forward, gradient of the
activations, gradient of the weights), an inference sample one.

    python benchmarks/fast_modes.py                                 # cifar10, batch 32 and 128
    python benchmarks/fast_modes.py --batch-size 128 --backend torch --limit 8192 --epochs 4
    python benchmarks/fast_modes.py --mode torch:compile --precision bf16 --peak fp32=430 --peak bf16=2600

Modes and precisions come from the registry (``benchbackend list``); ``--mode``/``--precision``
pick some (``--mode`` may name a mode the registry does not list yet). fp16 needs CUDA and is
left out on CPU. This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend.backends import registry as backends  # noqa: E402
from benchbackend.data import arrays  # noqa: E402
from benchbackend.results import TRAIN_FLOPS_FACTOR  # noqa: E402
from benchbackend.run.launch import Job  # noqa: E402
from benchbackend.spec import workload as W  # noqa: E402
from benchbackend.spec.model import flops_per_sample  # noqa: E402

PEAK_CODE = """
import json, sys
from benchbackend.spec import workload
from benchbackend.run.worker import load_class
cls = load_class(sys.argv[1])
b = cls(workload.load("mnist"), sys.argv[2], sys.argv[3])
print(json.dumps({p: b.gemm_peak(p) for p in sys.argv[4:]}))
"""


def _env(spec: backends.BackendSpec, device: str) -> dict[str, str]:
    return {**os.environ, **spec.env(device), "PYTHONPATH": str(ROOT)}


def gemm_peaks(spec: backends.BackendSpec, device: str, precisions: list[str]) -> dict[str, float]:
    """FLOP/s per precision from the backend's ``gemm_peak``, in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", PEAK_CODE, spec.target, device, spec.default_mode, *precisions],
                          capture_output=True, text=True, env=_env(spec, device), cwd=ROOT)
    if proc.returncode:
        print(f"  {spec.name}: gemm_peak failed: {proc.stderr.strip().splitlines()[-1:]}")
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cell(spec: backends.BackendSpec, workload: W.Workload, mode: str, precision: str, device: str,
             data_path: str) -> tuple[list[dict[str, Any]], Optional[str]]:
    """The rows of one cell, and a reason when it did not run (unavailable, error)."""
    job = Job.for_spec(spec, workload, mode=mode, precision=precision, device=device, repeat=0, data=data_path)
    proc = subprocess.run([sys.executable, "-m", "benchbackend.run.worker"], input=job.to_json(),
                          capture_output=True, text=True, env=_env(spec, device), cwd=ROOT)
    rows, why = [], None
    for line in proc.stdout.splitlines():
        msg = json.loads(line)
        if msg["type"] == "row":
            rows.append(msg)
        elif msg["type"] in ("unavailable", "error"):
            why = f"{msg['type']}: {msg['message']}"
    if proc.returncode and why is None:
        why = f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    return rows, why


def steady(rows: list[dict[str, Any]], phase: str) -> Optional[float]:
    """Median samples/s of a phase without its first epoch/pass (compilation, first copies)."""
    values = [r["samples_per_s"] for r in rows if r.get("phase") == phase and r.get("samples_per_s")]
    return statistics.median(values[1:] if len(values) > 1 else values) if values else None


def _selection(args: argparse.Namespace, device: str) -> list[tuple[backends.BackendSpec, str, str]]:
    cells = []
    for name in args.backend:
        spec = backends.get(name)
        modes = [m.split(":", 1)[1] for m in args.mode if m.startswith(name + ":")] or list(spec.mode_names)
        # By default fp64 (a reference precision) and, on CPU, fp16 (CUDA only) are left out.
        precisions = args.precision or [p for p in spec.precisions
                                        if p != "fp64" and not (p == "fp16" and device == "cpu")]
        cells += [(spec, m, p) for m in modes for p in precisions]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--backend", action="append", help="torch, tensorflow (repeatable; default both)")
    parser.add_argument("--mode", action="append", default=[], help="BACKEND:MODE (repeatable; default all)")
    parser.add_argument("--precision", action="append", help="fp32, bf16, fp16 (repeatable; default all)")
    parser.add_argument("--batch-size", type=int, action="append", help="repeatable; default 32 and 128")
    parser.add_argument("--limit", type=int, default=8192, help="training samples per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="the first is left out of the median")
    parser.add_argument("--passes", type=int, default=4, help="inference passes (the first left out)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--peak", action="append", default=[], metavar="PRECISION=GFLOPS",
                        help="use this GEMM peak instead of measuring it (repeatable)")
    args = parser.parse_args()
    args.backend = args.backend or ["torch", "tensorflow"]
    batch_sizes = args.batch_size or [32, 128]

    base = W.load(args.workload).with_overrides(limit=args.limit, epochs=args.epochs)
    base = base.model_copy(update={"inference": base.inference.model_copy(update={"repeats": args.passes})})
    fwd = flops_per_sample(base)
    print(f"{base.name}: forward {fwd / 1e6:.1f} MFLOP/sample; training counted as {TRAIN_FLOPS_FACTOR}x "
          f"= {TRAIN_FLOPS_FACTOR * fwd / 1e6:.1f} MFLOP/sample")

    cells = _selection(args, args.device)
    precisions = sorted({p for _, _, p in cells})
    given = {p: float(g) * 1e9 for p, _, g in (x.partition("=") for x in args.peak)}
    measured: dict[str, float] = {}
    todo = [p for p in precisions if p not in given and not (p == "fp16" and args.device == "cpu")]
    specs = {s.name: s for s, _, _ in cells}.values() if todo else []
    for spec in specs:
        for p, flops in gemm_peaks(spec, args.device, todo).items():
            print(f"GEMM peak {spec.name} {p}: {flops / 1e9:.0f} GFLOP/s")
            measured[p] = max(measured.get(p, 0.0), flops)
    peaks = {**measured, **given}

    with tempfile.TemporaryDirectory() as tmp:
        print(f"\n{'batch':>5} {'backend:mode@precision':<36} {'train/s':>9} {'MFU':>6} {'infer/s':>9} {'MFU':>6}")
        for bs in batch_sizes:
            w = base.with_overrides(batch_size=bs)
            path = os.path.join(tmp, f"data-{bs}.npz")
            arrays.prepare(w, "synthetic", None, Path(path))
            for spec, mode, precision in cells:
                label = f"{spec.name}:{mode}@{precision}"
                rows, why = run_cell(spec, w, mode, precision, args.device, path)
                if why:
                    print(f"{bs:>5} {label:<36} {why}")
                    continue
                train, infer = steady(rows, "train_epoch"), steady(rows, "inference")
                peak = peaks.get(precision)

                def mfu(rate: Optional[float], factor: int) -> str:
                    return f"{100 * rate * factor * fwd / peak:5.1f}%" if rate and peak else "     -"

                print(f"{bs:>5} {label:<36} {train or 0:9.0f} {mfu(train, TRAIN_FLOPS_FACTOR)} "
                      f"{infer or 0:9.0f} {mfu(infer, 1)}")


if __name__ == "__main__":
    main()
