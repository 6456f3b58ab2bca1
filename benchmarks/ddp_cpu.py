"""Data parallel on a CPU: where a two-replica torch DDP cell's time goes, against what the machine allows.

``benchbackend run W -b torch --replicas 1 --replicas 2`` reports a scaling efficiency of
``t(1 replica on every core) / (2 x t(2 replicas))``. On a CPU the replicas split the cores, so that
figure mixes three things, which this script measures apart, each condition in its own fresh process,
the conditions interleaved round by round (A B C ... A B C ...) so drift hits them alike:

- ``one``: the single replica on all the cell's threads (the baseline of the product's efficiency);
- ``one-1t``: the single replica on one thread per replica's share (``t1``): how well one process
  uses the cores it is given (intra-op scaling: ``one-1t / one``);
- ``half``: one replica's share of the work alone (half the samples at half the batch, one thread);
- ``pair``: two replicas at once, each on its share of the threads, without any gradient all-reduce
  (the product's replica processes with DDP left out; only the epoch's totals are reduced at its end):
  what the machine gives two processes (``half / pair``: memory bandwidth, caches, the harness);
- ``ddp``: the product's DDP replicas as shipped, and ``ddp:NAME`` for DistributedDataParallel
  arguments given with ``--variant NAME='{"bucket_cap_mb": 1}'`` (``before``: DDP's defaults, the
  adapter's arguments before issue 40); a condition ending ``+pin`` pins replica r to core r.

Replica 0's step is split into forward, backward (which ends when DDP's last bucket is reduced) and
the optimizer step; ``comm`` is the adapter's ``comm_seconds`` (a bucket's all-reduce in flight).
From these: the efficiency the product reports (``one / (2 ddp)``), its ceiling on this machine
without communication (``one / (2 pair)``), and the efficiency per core (``one-1t / (2 ddp)``).

    python benchmarks/ddp_cpu.py --workload resnet20 --limit 2560 --epochs 3 --rounds 3
    python benchmarks/ddp_cpu.py --only ddp --only ddp:before --variant before='{}' --rounds 3

This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: DistributedDataParallel arguments of a ``ddp:NAME`` condition, read by every replica process.
VARIANT_ENV = "BENCHBACKEND_DDP_VARIANT"
#: ``pin``: replica r's process on core r (os.sched_setaffinity), to see what the scheduler's
#: placement costs.
PIN_ENV = "BENCHBACKEND_DDP_PIN"
BEFORE = "{}"  # DistributedDataParallel's own defaults: the adapter's arguments before issue 40


try:  # the product's DDP adapter, instrumented; module-level, so the spawned replicas find it by name
    from benchbackend.backends.torch.replicas import TorchDDPBackend
except ImportError:  # torch absent
    TorchDDPBackend = object


class Timed(TorchDDPBackend):
    """The product's adapter, timing replica 0's step phases (forward, backward until DDP's last
    bucket is reduced, optimizer), with ``ddp:NAME``'s DistributedDataParallel arguments."""

    phases: dict[str, float] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get(PIN_ENV) and self.world > 1:
            os.sched_setaffinity(0, {self.rank % (os.cpu_count() or 1)})

    def _ddp_options(self):
        raw = os.environ.get(VARIANT_ENV)
        return super()._ddp_options() if raw is None else json.loads(raw)

    def _step(self, xb, yb, weight):
        clock, seen, marks = time.perf_counter, Timed.phases, {}
        t0 = clock()
        with self._autocast():
            logits = self.train_model(xb)
            loss = self._loss(logits, yb)
        t1 = clock()
        step = self.opt.step

        def timed_step(*a, **k):
            marks["step"] = clock()
            return step(*a, **k)

        self.opt.step = timed_step
        try:
            self._backward_step(loss if weight == 1.0 else loss * weight)
        finally:
            del self.opt.step
        t2 = clock()
        for key, seconds in (("forward", t1 - t0), ("backward", marks["step"] - t1), ("optimizer", t2 - marks["step"])):
            seen[key] = seen.get(key, 0.0) + seconds
        return loss.detach(), logits.detach()


class NoComm(Timed):
    """Two replica processes as the product runs them, without DDP: no gradient all-reduce (their
    weights drift apart, which changes nothing of the time); the epoch's totals are still reduced."""

    def _wrap(self):
        self.ddp = None
        self.train_model = self.net

    def _hook(self):
        self._comm = None


def measure(condition: str, workload_name: str, limit: int, epochs: int, threads: int) -> dict:
    """Runs in a fresh process: one condition's steady epoch time and replica 0's step phases."""
    from benchbackend.backends.torch.adapter import TorchBackend
    from benchbackend.data import datasets as data
    from benchbackend.run.timing import timed_region
    from benchbackend.spec import model, workload

    w = workload.load(workload_name).with_overrides(limit=limit, epochs=epochs)
    bs = w.training.batch_size
    name, _, variant = condition.partition("+")[0].partition(":")
    if name == "half":  # one replica's work: half the samples at half the batch, alone
        w = workload.load(workload_name).with_overrides(limit=limit // 2, epochs=epochs, batch_size=bs // 2)
    ds = data.load(w, "synthetic")
    x = data.normalize(ds.x_train)
    orders = data.epoch_orders(len(ds.y_train), epochs, w.seed)
    weights = model.initial_weights(w, 1)
    options = {"threads": 2 * threads if name == "one" else threads}
    if name in ("ddp", "pair"):
        cls, options = (NoComm if name == "pair" else Timed), {"threads": threads, "replicas": 2}
    else:
        cls = TorchBackend
    adapter = cls(w, "cpu", "eager", "fp32", options)
    try:
        adapter.build(weights)
        adapter.set_data(x, ds.y_train)
        times, comm, phases = [], [], []
        for order in orders:
            adapter.barrier() if hasattr(adapter, "barrier") else None
            Timed.phases.clear() if name in ("ddp", "pair") else None
            if hasattr(adapter, "comm_seconds"):
                adapter.comm_seconds()
            _, seconds = timed_region(lambda: adapter.train_epoch(order), adapter.to_host, adapter.sync)
            times.append(seconds)
            comm.append(adapter.comm_seconds() if hasattr(adapter, "comm_seconds") else None)
            phases.append(dict(Timed.phases) if name in ("ddp", "pair") else {})
    finally:
        adapter.close()
    steps = -(-len(ds.y_train) // w.training.batch_size)
    steady = slice(1, None)  # epoch 1 apart: allocation, DDP's bucket rebuild
    out = {"condition": condition, "steps": steps, "epoch_s": float(np.median(times[steady])), "epochs": times,
           "threads": torch_threads(adapter)}
    if comm[-1] is not None:
        out["comm_s"] = float(np.median(comm[steady])) / steps
    for key in ("forward", "backward", "optimizer"):
        if phases[-1]:
            out[key] = float(np.median([p[key] for p in phases[steady]])) / steps
    return out


def torch_threads(adapter) -> int:
    return adapter.threads()


def _env(condition: str, threads: int, variants: dict[str, str], pin: bool) -> dict[str, str]:
    from benchbackend.run.launch import THREAD_VARS

    condition, plus, pinned = condition.partition("+")
    name, _, variant = condition.partition(":")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    n = 2 * threads if name == "one" else threads
    env.update({v: str(n) for v in THREAD_VARS})
    env.pop(VARIANT_ENV, None)
    if variant:
        env[VARIANT_ENV] = variants.get(variant, BEFORE if variant == "before" else "")
    if pin or pinned == "pin":
        env[PIN_ENV] = "1"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="resnet20")
    ap.add_argument("--limit", type=int, default=2560)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per condition")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="threads per replica (the single replica gets twice as many)")
    ap.add_argument("--only", action="append", default=[], help="conditions to run (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="DistributedDataParallel arguments of the condition ddp:NAME")
    ap.add_argument("--pin", action="store_true", help="pin replica r to core r")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.workload, args.limit, args.epochs, args.threads)))
        return
    variants = dict(v.split("=", 1) for v in args.variant)
    conditions = args.only or ["one", "one-1t", "half", "pair", "ddp:before", "ddp"]
    runs: dict[str, list[dict]] = {c: [] for c in conditions}
    for r in range(args.rounds):
        for c in conditions:
            cmd = [sys.executable, __file__, "--child", c, "--workload", args.workload, "--limit", str(args.limit),
                   "--epochs", str(args.epochs), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=_env(c, args.threads, variants, args.pin))
            if out.returncode:
                sys.exit(f"{c}: exit {out.returncode}\n{out.stderr[-3000:]}")
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {c}: {runs[c][-1]['epoch_s']:.3f} s", file=sys.stderr, flush=True)
    med = {c: {k: float(np.median([run[k] for run in rs])) for k in rs[0] if isinstance(rs[0][k], float)}
           for c, rs in runs.items()}
    print(f"{args.workload}, {args.limit} samples, {args.epochs} epochs, {args.rounds} rounds, {args.threads} "
          f"thread(s) per replica; medians (steady epochs, then rounds); per step in ms")
    print(f"{'condition':<14} {'epoch s':>8} {'step ms':>8} {'forward':>8} {'backward':>9} {'optim':>6} {'comm':>6}")
    for c, m in med.items():
        steps = runs[c][0]["steps"]
        cols = [m.get(k) for k in ("forward", "backward", "optimizer", "comm_s")]
        text = " ".join(f"{v * 1e3:>8.1f}" if v is not None else f"{'':>8}" for v in cols)
        print(f"{c:<14} {m['epoch_s']:>8.3f} {m['epoch_s'] / steps * 1e3:>8.1f} {text}")
    one = med.get("one", {}).get("epoch_s")
    for c, m in med.items():
        if c.startswith(("ddp", "pair")) and one:
            per_core = med.get("one-1t", {}).get("epoch_s")
            extra = f", per core (one-1t / 2 {c}) {per_core / (2 * m['epoch_s']):.2f}" if per_core else ""
            print(f"efficiency of {c}: one / (2 {c}) = {one / (2 * m['epoch_s']):.2f}{extra}")


if __name__ == "__main__":
    main()
