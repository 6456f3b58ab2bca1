"""Harness overhead for the `jax` backend: the adapter's steady epoch time against a plain jitted loop.

As ``benchmarks/overhead.py`` does for torch and tensorflow: one fresh process builds the adapter
(as the worker does) and a hand-written loop on the same network, initial weights, arrays and
sample order, then alternates epochs between the two so drift hits both alike. The plain loop is
what a JAX user writes: one ``jax.jit`` train step, batches sliced from the epoch's permuted
device arrays in a Python loop, the last loss fetched at the end. It shares the adapter's layer
functions and Keras update rule (the network and the maths are not what is measured; the loop
around them is). Prints the median steady epoch time of each and their ratio, the median over
--rounds fresh processes. ``--mode scan`` times the adapter's ``lax.scan`` mode against the same
plain loop (K = --steps-per-execution), which is where fewer dispatches per epoch show.

    python benchmarks/overhead_jax.py --workload mnist --limit 8192 --epochs 6
    python benchmarks/overhead_jax.py --workload cifar10 --limit 1024 --epochs 4 --mode scan

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


def _plain_jax(w, weights, x, y):
    import jax
    import jax.numpy as jnp

    from benchbackend.backends.jax import _init_state, _update, make_forward

    t = w.training
    logits = make_forward(w)
    params = [jnp.asarray(a) for a in weights]
    opt = _init_state(t.optimizer, t.momentum, params)
    key = jax.random.key(w.seed)
    xt, yt = jnp.asarray(x), jnp.asarray(y.astype(np.int32))
    bs = w.training.batch_size

    def loss_fn(p, xb, yb, k):
        z = logits(p, xb, k)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), yb[:, None], axis=1))

    @jax.jit
    def step(p, o, xb, yb, k):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb, k)
        p, o = _update(t.optimizer, t.lr, t.momentum, p, g, o)
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


def measure(workload_name: str, limit: int, epochs: int, mode: str, spe: int) -> dict:
    """Runs inside a fresh process."""
    from benchbackend import data, model, workload
    from benchbackend.backends.jax import JaxBackend
    from benchbackend.timing import timed_region

    w = workload.load(workload_name).with_overrides(limit=limit, epochs=epochs)
    ds = data.load(w, "synthetic")
    x = data.normalize(ds.x_train)
    orders = data.epoch_orders(len(ds.y_train), epochs, w.seed)
    weights = model.initial_weights(w, 1)
    adapter = JaxBackend(w, "cpu", mode, "fp32", {"steps_per_execution": spe})
    adapter.build(weights)
    adapter.set_data(x, ds.y_train)
    plain = _plain_jax(w, weights, x, ds.y_train)
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
    return {"workload": workload_name, "mode": mode, "samples": len(ds.y_train), **steady,
            "ratio": steady["adapter"] / steady["plain"], "epochs": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mnist")
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--mode", choices=["jit", "scan"], action="append", help="adapter mode(s); default jit")
    ap.add_argument("--steps-per-execution", type=int, default=32, help="K for --mode scan")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per mode; the median ratio is shown")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.workload, args.limit, args.epochs, args.child, args.steps_per_execution)))
        return
    print(f"{'mode':<6} {'workload':<8} {'samples':>7} {'adapter s':>10} {'plain s':>9} {'ratio':>7}  "
          f"ratios of {args.rounds} fresh processes")
    for mode in args.mode or ["jit"]:
        runs = []
        for _ in range(args.rounds):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--workload", args.workload,
                                  "--limit", str(args.limit), "--epochs", str(args.epochs),
                                  "--steps-per-execution", str(args.steps_per_execution)],
                                 capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
            if out.returncode != 0:
                print(f"{mode:<6} failed: {out.stderr.strip().splitlines()[-1:]}")
                break
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not runs:
            continue
        med = lambda k: float(np.median([r[k] for r in runs]))  # noqa: E731
        ratios = " ".join(f"{r['ratio']:.3f}" for r in runs)
        print(f"{mode:<6} {args.workload:<8} {runs[0]['samples']:>7} {med('adapter'):>10.4f} {med('plain'):>9.4f} "
              f"{med('ratio'):>7.3f}  {ratios}")


if __name__ == "__main__":
    main()
