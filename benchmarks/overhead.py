"""Harness overhead: the adapter's steady epoch time against a plain hand-written loop.

For each backend, one process builds the adapter (as the worker does) and a hand-written model
and loop in the same framework, on the same arrays, the same sample order and the same initial
weights, then alternates epochs between the two (adapter, plain, adapter, plain, ...) so drift
hits both alike. Prints the median steady epoch time of each and the ratio (target: within 3%), the
median over --rounds fresh processes.

The plain JAX loop is what a JAX user writes: one ``jax.jit`` train step, batches sliced from the
epoch's permuted device arrays in a Python loop. It shares the adapter's layer functions and
Keras update rule (the network and the maths are not what is measured; the loop around them is).
``--backend jax:scan`` times the adapter's ``lax.scan`` mode (K = --steps-per-execution) against
the same plain loop, which is where fewer dispatches per epoch show.

    python benchmarks/overhead.py --workload mnist --limit 8192 --epochs 6
    python benchmarks/overhead.py --workload cifar10 --limit 1024 --epochs 4 --backend torch
    python benchmarks/overhead.py --workload mnist --backend jax --backend jax:scan

This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _plain_torch(w, weights, x, y, orders):
    import copy

    import torch
    import torch.nn.functional as F

    from benchbackend.backends.torch.adapter import TorchBackend

    # The same network and weights (a deep copy of a separately built adapter's module), driven
    # by the loop a user would write: slices of a pre-permuted tensor, no harness around it.
    ref = TorchBackend(w, "cpu")
    ref.build(weights)
    net = copy.deepcopy(ref.net)
    kw = {k: v for k, v in ref.opt.defaults.items() if k in ("lr", "momentum", "nesterov", "betas", "eps", "alpha")}
    kernels, l2 = net.kernels(), ref.l2
    if ref.decoupled:  # what a torch user writes for a decoupled decay on the kernels: AdamW, two groups
        # The attention's kernels are views of its nn.Linear weights: the optimizer takes those.
        leaves = list({id(b): b for b in (k if k._base is None else k._base for k in kernels)}.values())
        ids = {id(k) for k in leaves}
        opt = torch.optim.AdamW([{"params": leaves, "weight_decay": w.training.weight_decay.rate},
                                 {"params": [p for p in net.parameters() if id(p) not in ids], "weight_decay": 0.0}],
                                **kw)
    else:
        opt = ref.opt.__class__(net.parameters(), **kw)
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    yt = torch.from_numpy(y)
    bs = w.training.batch_size

    def epoch(order):
        xe, ye = xt[torch.from_numpy(order)], yt[torch.from_numpy(order)]
        for s in range(0, len(order), bs):
            loss = F.cross_entropy(net(xe[s:s + bs]), ye[s:s + bs])
            if l2:
                loss = loss + l2 * sum((k * k).sum() for k in kernels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    return epoch


def _plain_tensorflow(w, weights, x, y, orders):
    import keras
    import tensorflow as tf

    from benchbackend.backends.keras.layers import keras3_optimizer
    from benchbackend.backends.tensorflow.adapter import TensorFlowBackend

    ref = TensorFlowBackend(w, "cpu")
    net = ref._net()
    net.set(weights)
    model = net.model
    opt = keras3_optimizer(keras, w, net)
    loss_fn = keras.losses.CategoricalCrossentropy()
    nc = w.num_classes
    xt, yt = tf.constant(x), tf.constant(y)
    bs = w.training.batch_size

    @tf.function(reduce_retracing=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.one_hot(yb, nc), model(xb, training=True))
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def epoch(order):
        idx = tf.constant(order)
        xe, ye = tf.gather(xt, idx), tf.gather(yt, idx)
        for s in range(0, len(order), bs):
            loss = step(xe[s:s + bs], ye[s:s + bs])
        return float(loss)

    return epoch


def _plain_jax(w, weights, x, y, orders):
    import jax
    import jax.numpy as jnp

    from benchbackend.backends.jax.adapter import _init_state, _update
    from benchbackend.backends.jax.graph import make_forward
    from benchbackend.spec.model import kernel_mask

    t = w.training
    logits, graph = make_forward(w)
    kernels = kernel_mask(graph)
    l2 = t.weight_decay.rate if t.weight_decay is not None and t.weight_decay.kind == "l2" else 0.0
    # Every weight array is differentiated and stepped: batchnorm's moving statistics get zero
    # gradients, which leave them as they are (their moving-average update, a few element-wise
    # ops, is left out of this loop).
    params = [jnp.asarray(a) for a in weights]
    opt = _init_state(t.optimizer, t.momentum, params)
    key = jax.random.key(w.seed)
    xt, yt = jnp.asarray(x), jnp.asarray(y.astype(np.int32))
    bs = w.training.batch_size

    def loss_fn(p, xb, yb, k):
        z, _ = logits(p, xb, k, True)
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), yb[:, None], axis=1))
        return loss + l2 * sum(jnp.sum(a * a) for a, is_k in zip(p, kernels) if is_k) if l2 else loss

    @jax.jit
    def step(p, o, xb, yb, k):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb, k)
        p, o = _update(t.optimizer, t.lr, t.momentum, p, g, o, t.nesterov)
        return p, o, loss

    state = {"params": params, "opt": opt, "step": 0}

    def epoch(order):
        idx = jnp.asarray(order.astype(np.int32))
        xe, ye = xt[idx], yt[idx]
        p, o, i = state["params"], state["opt"], state["step"]
        for s in range(0, len(order), bs):
            p, o, loss = step(p, o, xe[s:s + bs], ye[s:s + bs], jax.random.fold_in(key, i))
            i += 1
        state.update(params=p, opt=o, step=i)
        return float(loss)

    return epoch


def measure(backend: str, workload_name: str, limit: int, epochs: int, spe: int = 32) -> dict:
    """Runs inside a fresh process for one backend."""
    from benchbackend.backends.registry import get
    from benchbackend.data import datasets as data
    from benchbackend.run.timing import timed_region
    from benchbackend.spec import model, workload

    backend, _, mode = backend.partition(":")  # e.g. jax:scan
    spec = get(backend)
    for k, v in spec.env("cpu").items():
        os.environ.setdefault(k, v)
    w = workload.load(workload_name).with_overrides(limit=limit, epochs=epochs)
    ds = data.load(w, "synthetic")
    x, xv, xte = (data.normalize(a) for a in (ds.x_train, ds.x_val, ds.x_test))
    orders = data.epoch_orders(len(ds.y_train), epochs, w.seed)
    weights = model.initial_weights(w, 1)
    adapter = spec.load_class()(w, "cpu", mode or spec.default_mode, "fp32", {"steps_per_execution": spe})
    adapter.build(weights)
    adapter.set_data(x, ds.y_train)
    plain = {"torch": _plain_torch, "tensorflow": _plain_tensorflow, "jax": _plain_jax}[backend](
        w, weights, x, ds.y_train, orders)
    times: dict[str, list[float]] = {"adapter": [], "plain": []}
    for e, order in enumerate(orders):
        # The adapter is timed as the worker times it: to_host on its result, sync, then the clock.
        timed_adapter = lambda: timed_region(lambda: adapter.train_epoch(order), adapter.to_host, adapter.sync)  # noqa: E731
        timed_plain = lambda: timed_region(lambda: plain(order), None, lambda: None)  # noqa: E731
        first, second = (("adapter", timed_adapter), ("plain", timed_plain))[:: 1 if e % 2 == 0 else -1]
        for name, fn in (first, second):
            _, s = fn()
            times[name].append(s)
    steady = {k: float(np.median(v[1:])) for k, v in times.items()}  # epoch 1 apart: tracing, warm-up
    return {"backend": f"{backend}:{adapter.mode}", "workload": workload_name, "samples": len(ds.y_train), **steady,
            "ratio": steady["adapter"] / steady["plain"], "epochs": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mnist")
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--backend", action="append", choices=["torch", "tensorflow", "jax", "jax:scan"],
                    help="default: torch and tensorflow; jax:scan times the scan mode against the plain jitted loop")
    ap.add_argument("--steps-per-execution", type=int, default=32, help="K for jax:scan")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per backend; the median ratio is shown")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.workload, args.limit, args.epochs, args.steps_per_execution)))
        return
    print(f"{'backend':<11} {'workload':<8} {'samples':>7} {'adapter s':>10} {'plain s':>9} {'ratio':>7}  "
          f"ratios of {args.rounds} fresh processes")
    for backend in args.backend or ["torch", "tensorflow"]:
        runs = []
        for _ in range(args.rounds):
            out = subprocess.run([sys.executable, __file__, "--child", backend, "--workload", args.workload,
                                  "--limit", str(args.limit), "--epochs", str(args.epochs),
                                  "--steps-per-execution", str(args.steps_per_execution)],
                                 capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
            if out.returncode != 0:
                print(f"{backend:<11} failed: {out.stderr.strip().splitlines()[-1:]}")
                break
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not runs:
            continue
        med = lambda k: float(np.median([r[k] for r in runs]))  # noqa: E731
        ratios = " ".join(f"{r['ratio']:.3f}" for r in runs)
        print(f"{backend:<11} {args.workload:<8} {runs[0]['samples']:>7} {med('adapter'):>10.4f} {med('plain'):>9.4f} "
              f"{med('ratio'):>7.3f}  {ratios}")

if __name__ == "__main__":
    main()
