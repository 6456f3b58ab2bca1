"""How far correct float32 training drifts from the float64 reference: the evidence behind a
workload's ``checks.trajectory_rtol``.

For each initial-weight seed, K training steps (dropout off, the worker's batches) are run by:
the NumPy reference in float64 (the yardstick) and in float32, by each named backend's adapter,
and by deliberately wrong rules computed by the reference (Adam or SGD at 1.05x and 1.1x the
learning rate; for Adam also torch's epsilon placement; for Nesterov plain momentum) and wrong
conventions (no weight decay, twice the L2, torch's batchnorm epsilon). Prints, per implementation, the largest
relative loss difference from the float64 run over the K steps, per seed. A tolerance is sound
when it lies above every correct implementation and below the wrong rules it must catch.

    python benchmarks/trajectory_spread.py --workload cifar10 --seeds 5 --backend jax --backend torch
    python benchmarks/trajectory_spread.py --workload mnist --seeds 4 --backend tensorflow
    python benchmarks/trajectory_spread.py --workload cifar10 --seeds 3 --steps 10 --precision bf16 \
        --backend torch --backend tensorflow --backend jax

``--precision`` runs the adapters in a reduced precision (bf16, fp16; tf32 needs a GPU): the
evidence behind ``checks.trajectory_tolerance`` of that precision. The reference float32 row and
the wrong rules stay as they are, so the table shows which wrong rule a tolerance that admits the
correct reduced-precision runs can still catch.

Backends run in this process, one after another: keras-jax and keras-torch cannot share a process
with tensorflow (one Keras backend per process); name them in runs of their own. A figure, not a test.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchbackend.backends import registry as backends  # noqa: E402
from benchbackend.backends.numpy import ops, reference  # noqa: E402
from benchbackend.data import datasets as data  # noqa: E402
from benchbackend.spec import model, workload  # noqa: E402


class TorchStyleAdam(ops.Adam):
    """Adam with epsilon added after the bias correction (torch.optim.Adam), not before (Keras)."""

    def step(self, params, grads):  # type: ignore[no-untyped-def]
        if self.m is None or self.v is None:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m += (g - m) * (1 - self.beta_1)
            v += (g * g - v) * (1 - self.beta_2)
            p -= self.lr * (m / (1 - self.beta_1 ** self.t)) / (np.sqrt(v / (1 - self.beta_2 ** self.t)) + self.epsilon)


def wrong_rules(w: workload.Workload) -> dict[str, ops.Optimizer]:
    t = w.training
    scaled = {f"wrong: lr x{f}": t.model_copy(update={"lr": t.lr * f}) for f in (1.05, 1.1)}
    out = {name: ops.make_optimizer(spec) for name, spec in scaled.items()}
    if t.optimizer == "adam":
        out["wrong: torch-style epsilon"] = TorchStyleAdam(t.lr)
    if t.nesterov:
        out["wrong: plain momentum (no Nesterov)"] = ops.SGD(t.lr, t.momentum)
    return out


def _with(w: workload.Workload, training: dict | None = None, batchnorm: dict | None = None) -> workload.Workload:
    layers = [layer.model_copy(update=batchnorm) if batchnorm and layer.type == "batchnorm" else layer
              for layer in w.model]
    return w.model_copy(update={"model": layers, "training": w.training.model_copy(update=training or {})})


def wrong_conventions(w: workload.Workload) -> dict[str, workload.Workload]:
    """The workload with one convention a framework might keep by default: what the check should see."""
    out: dict[str, workload.Workload] = {}
    decay = w.training.weight_decay
    if decay is not None and decay.kind == "l2":
        out["wrong: no weight decay"] = _with(w, {"weight_decay": None})
        out["wrong: L2 x2 (torch's weight_decay=rate)"] = _with(w, {"weight_decay": decay.model_copy(
            update={"rate": 2 * decay.rate})})
    if any(layer.type == "batchnorm" for layer in w.model):
        out["wrong: batchnorm epsilon 1e-5 (torch's)"] = _with(w, batchnorm={"epsilon": 1e-5})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="cifar10")
    parser.add_argument("--seeds", type=int, default=5, help="initial-weight seeds 0..N-1 (repeat numbers)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", action="append", default=[], help="an adapter to run too (repeatable)")
    parser.add_argument("--precision", default="fp32", help="the adapters' precision (fp32, bf16, fp16, tf32)")
    args = parser.parse_args()

    w = workload.load(args.workload)
    bs = w.training.batch_size
    w = w.with_overrides(limit=max(bs * args.steps, 256), epochs=1)
    ds = data.load(w, "synthetic")
    x, y = data.normalize(ds.x_train), ds.y_train
    order = data.epoch_orders(len(y), 1, w.seed)[0]
    batches = [(x[order[i * bs:(i + 1) * bs]], y[order[i * bs:(i + 1) * bs]]) for i in range(args.steps)]
    print(f"{w.name}: {args.steps} steps of batch {bs}, {w.training.optimizer} lr {w.training.lr:g}; "
          f"trajectory_rtol now {w.checks.trajectory_rtol:g}. Largest relative loss difference "
          f"from the float64 reference, per seed:")
    table: dict[str, list[float]] = {}
    per_step: dict[str, np.ndarray] = {}  # the largest relative difference at each step, over the seeds
    for seed in range(args.seeds):
        weights = model.initial_weights(w, seed)
        yardstick = np.array(reference.train_losses(w, weights, batches, np.float64))
        runs = {"reference float32": reference.train_losses(w, weights, batches, np.float32)}
        for name in args.backend:
            spec = backends.get(name)
            adapter = spec.load_class()(w, "cpu", spec.default_mode, args.precision, {})
            adapter.build([np.array(a) for a in weights])
            runs[f"{name} {args.precision}"] = adapter.train_steps(batches)
        for name, opt in wrong_rules(w).items():
            runs[name] = reference.train_losses(w, weights, batches, np.float64, opt)
        for name, variant in wrong_conventions(w).items():
            runs[name] = reference.train_losses(variant, weights, batches, np.float64)
        for name, losses in runs.items():
            rel = np.abs(np.array(losses) - yardstick) / np.abs(yardstick)
            rel = np.where(np.isfinite(rel), rel, np.inf)
            table.setdefault(name, []).append(float(np.max(rel)))
            per_step[name] = np.maximum(per_step.get(name, 0.0), rel)
    width = max(len(n) for n in table)
    for name, values in table.items():
        print(f"  {name:<{width}}  max {max(values):8.1e}   " + " ".join(f"{v:7.1e}" for v in values))
    print("Largest relative difference at each step 1..K, over the seeds:")
    for name, values in per_step.items():
        print(f"  {name:<{width}}  " + " ".join(f"{v:7.1e}" for v in values))


if __name__ == "__main__":
    main()
