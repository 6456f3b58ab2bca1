"""Every training framework's adapter side by side with the loop its own tutorials write.

One command, every pair, on resnet20 and vit-tiny. Each pair is one adapter and one hand-written
loop in the same framework, built in the same fresh process on the same arrays, the same sample
order, the same initial weights and the same threads (the framework's default: every core),
whose epochs alternate (adapter, own, own, adapter, ...) so drift hits both alike. The adapter is
timed as the worker times it (``timed_region``: its result to the host, sync, then the clock);
an own loop ends on a host value of its own (a float loss, or Keras' history). Steady epoch = the
median of epochs 3..N; the ratio adapter / own is the median over ``--rounds`` fresh processes,
run round by round (every pair and workload of round r before round r+1).

The own loops:

- ``torch``: ``for`` over slices of a pre-permuted tensor, ``loss.backward()``, ``opt.step()``
  (``overhead.py``'s, with ``torch.optim.AdamW`` for a decoupled decay);
- ``tensorflow``: a custom loop under ``tf.function`` over a Keras model (``overhead.py``'s);
- ``tensorflow-fit``, ``keras-jax``, ``keras-torch``: Keras 3's ``model.compile`` and
  ``model.fit(x, y, batch_size=...)`` on NumPy arrays, as the Keras guides write it, with the
  ``accuracy`` metric, on TensorFlow, JAX and PyTorch; the ``tensorflow`` adapter is a custom
  loop over a Keras model, so it is held against both;
- ``jax``: a ``jax.jit`` train step with optax (``optax.sgd``/``adam``/``adamw``, ``apply_updates``),
  batchnorm's statistics carried beside the parameters as flax's ``batch_stats`` are, batches
  sliced from NumPy arrays in Python as flax's examples do. Same forward (``jax/graph.py``): the
  network is not what is measured. optax's Adam puts epsilon elsewhere than Keras (the adapter's
  rule): the same work, not the same numbers;
- ``chainer``: Chainer's custom-loop example (``train_mnist_custom_loop.py``): a
  ``SerialIterator`` over a ``TupleDataset``, ``concat_examples``, ``L.Classifier`` and
  ``optimizer.update(model, x, t)``, Chainer's own ``NesterovAG``/``Adam``, the L2 penalty as a
  ``WeightDecay`` hook on the kernels. It runs in the chainer environment's interpreter
  (``benchbackend setup chainer``; ``$BENCHBACKEND_ENVS``).

    python benchmarks/loops.py                                   # every pair, resnet20 and vit-tiny
    python benchmarks/loops.py --pair keras-torch --workload vit-tiny --rounds 3

This is a figure, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Epoch = Callable[[np.ndarray], Any]

#: pair -> (adapter backend[:mode], own loop). Sizes per workload keep a round near a minute.
PAIRS = {
    "torch": ("torch", "torch"),
    "tensorflow": ("tensorflow", "tf.function"),
    "tensorflow-fit": ("tensorflow", "keras-fit"),
    "jax": ("jax", "optax"),
    "keras-jax": ("keras-jax", "keras-fit"),
    "keras-torch": ("keras-torch", "keras-fit"),
    "chainer": ("chainer", "chainer"),
}
LIMITS = {"resnet20": 1024, "vit-tiny": 512}
SLOW = {"chainer": 0.5}  # Chainer on NumPy is several times slower: fewer samples


def _keras_fit(w, weights, x, y, orders) -> Epoch:
    import keras

    from benchbackend.backends.keras.layers import keras3_build, keras3_optimizer

    net = keras3_build(w, keras)  # the spec's network as a Keras functional model
    net.set(weights)
    model = net.model
    model.compile(optimizer=keras3_optimizer(keras, w, net), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    yi = y.astype(np.int32)
    bs = w.training.batch_size

    def epoch(order):
        history = model.fit(x[order], yi[order], batch_size=bs, epochs=1, shuffle=False, verbose=0)
        return history.history["loss"][-1]

    return epoch


def _optax(w, weights, x, y, orders) -> Epoch:
    import jax
    import jax.numpy as jnp
    import optax

    from benchbackend.backends.jax.graph import make_forward
    from benchbackend.spec.model import kernel_mask, trainable_mask

    t, decay = w.training, w.training.weight_decay
    logits, graph = make_forward(w)
    trains = trainable_mask(graph)
    kernels = [k for k, m in zip(kernel_mask(graph), trains) if m]
    momenta = [n.layer.momentum for n in graph.nodes if n.kind == "batchnorm" for _ in (0, 1)]
    l2 = decay.rate if decay is not None and decay.kind == "l2" else 0.0
    params = [jnp.asarray(a) for a, m in zip(weights, trains) if m]
    batch_stats = [jnp.asarray(a) for a, m in zip(weights, trains) if not m]
    if t.optimizer == "sgd":
        tx = optax.sgd(t.lr, momentum=t.momentum or None, nesterov=t.nesterov)
    elif t.optimizer == "adam" and decay is not None and decay.kind == "decoupled":
        tx = optax.adamw(t.lr, eps=1e-7, weight_decay=decay.rate, mask=kernels)
    elif t.optimizer == "adam":
        tx = optax.adam(t.lr, eps=1e-7)
    else:
        tx = optax.rmsprop(t.lr, decay=0.9, eps=1e-7)
    opt_state = tx.init(params)

    def merge(p, s):
        it_p, it_s = iter(p), iter(s)
        return [next(it_p) if m else next(it_s) for m in trains]

    def loss_fn(p, s, xb, yb, key):
        z, stats = logits(merge(p, s), xb, key, True)
        loss = optax.softmax_cross_entropy_with_integer_labels(z, yb).mean()
        if l2:
            loss = loss + l2 * sum(jnp.sum(a * a) for a, k in zip(p, kernels) if k)
        return loss, [b for pair in stats for b in pair]

    @jax.jit
    def train_step(p, s, o, xb, yb, key):
        (loss, batch), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, s, xb, yb, key)
        updates, o = tx.update(grads, o, p)
        p = optax.apply_updates(p, updates)
        s = [m * a + (1.0 - m) * b for a, b, m in zip(s, batch, momenta)]
        return p, s, o, loss

    state = {"p": params, "s": batch_stats, "o": opt_state, "step": 0}
    key = jax.random.key(w.seed)
    yi = y.astype(np.int32)
    bs = t.batch_size

    def epoch(order):
        p, s, o, i = state["p"], state["s"], state["o"], state["step"]
        for start in range(0, len(order), bs):
            idx = order[start:start + bs]
            p, s, o, loss = train_step(p, s, o, x[idx], yi[idx], jax.random.fold_in(key, i))
            i += 1
        state.update(p=p, s=s, o=o, step=i)
        return float(loss)

    return epoch


def _chainer(w, weights, x, y, orders) -> Epoch:
    import chainer
    import chainer.links as L
    from chainer import iterators, optimizer_hooks, optimizers
    from chainer.dataset import concat_examples
    from chainer.datasets import TupleDataset

    from benchbackend.backends.chainer.adapter import ChainerBackend

    ref = ChainerBackend(w, "cpu", "define-by-run")
    ref.build(weights)
    net = copy.deepcopy(ref.net)  # the same chain on the same weights, built by a separate adapter
    model = L.Classifier(net)
    t, decay = w.training, w.training.weight_decay
    if t.optimizer == "sgd" and t.nesterov:
        opt = optimizers.NesterovAG(lr=t.lr, momentum=t.momentum)
    elif t.optimizer == "sgd":
        opt = optimizers.MomentumSGD(lr=t.lr, momentum=t.momentum) if t.momentum else optimizers.SGD(lr=t.lr)
    elif t.optimizer == "adam":
        opt = optimizers.Adam(alpha=t.lr, eps=1e-7)
    else:
        opt = optimizers.RMSprop(lr=t.lr, alpha=0.9, eps=1e-7, eps_inside_sqrt=True)
    opt.setup(model)
    for k in net.kernels():  # the decay on the kernels only, as the workload says
        if decay is not None and decay.kind == "l2":
            k.update_rule.add_hook(optimizer_hooks.WeightDecay(2 * decay.rate))  # d(rate * k^2)/dk
        elif decay is not None:
            k.update_rule.hyperparam.weight_decay_rate = decay.rate * t.lr  # Adam's decoupled decay
    xc = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x  # Chainer's NCHW
    yi = y.astype(np.int32)
    bs = t.batch_size

    def epoch(order):
        it = iterators.SerialIterator(TupleDataset(xc[order], yi[order]), bs, repeat=False, shuffle=False)
        with chainer.using_config("train", True):
            for batch in it:
                xb, tb = concat_examples(batch)
                opt.update(model, xb, tb)
        return float(model.loss.array)

    return epoch


def _own_loop(name: str) -> Callable[..., Epoch]:
    if name in ("torch", "tf.function"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import overhead

        return overhead._plain_torch if name == "torch" else overhead._plain_tensorflow
    return {"keras-fit": _keras_fit, "optax": _optax, "chainer": _chainer}[name]


def measure(pair: str, workload_name: str, limit: int, epochs: int, warmup: int = 2) -> dict:
    """Runs inside a fresh process for one pair."""
    from benchbackend.backends.registry import get
    from benchbackend.data import datasets as data
    from benchbackend.run.timing import timed_region
    from benchbackend.spec import model, workload

    backend, own = PAIRS[pair]
    spec = get(backend)
    w = workload.load(workload_name).with_overrides(limit=limit, epochs=epochs)
    ds = data.load(w, "synthetic")
    x = data.normalize(ds.x_train)
    orders = data.epoch_orders(len(ds.y_train), epochs, w.seed)
    weights = model.initial_weights(w, 1)
    adapter = spec.load_class()(w, "cpu", spec.default_mode, "fp32", {})
    adapter.build(weights)
    adapter.set_data(x, ds.y_train)
    plain = _own_loop(own)(w, weights, x, ds.y_train, orders)
    times: dict[str, list[float]] = {"adapter": [], "own": []}
    for e, order in enumerate(orders):
        timed = {"adapter": lambda: timed_region(lambda: adapter.train_epoch(order), adapter.to_host, adapter.sync),
                 "own": lambda: timed_region(lambda: plain(order), None, lambda: None)}
        for name in ("adapter", "own") if e % 2 == 0 else ("own", "adapter"):
            times[name].append(timed[name]()[1])
    # The first epochs apart: tracing, compiling, and TensorFlow's own warm-up (its epochs 2 and 3
    # were still 5-20% slower than later ones on resnet20).
    steady = {k: float(np.median(v[warmup:])) for k, v in times.items()}
    return {"pair": pair, "adapter": f"{backend}:{adapter.mode}", "own": own, "workload": workload_name,
            "samples": len(ds.y_train), "steady": steady, "ratio": steady["adapter"] / steady["own"],
            "epochs": times}


def _child(pair: str, workload_name: str, limit: int, epochs: int, warmup: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one pair's fresh process: the backend's variables set before
    any framework is imported; Chainer in its own environment's interpreter."""
    from benchbackend.backends import envs
    from benchbackend.backends.registry import get

    spec = get(PAIRS[pair][0])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **spec.env("cpu")}
    python = sys.executable
    if spec.isolated_env:
        python, env = str(envs.python_for(spec.isolated_env)), {**envs.worker_env(env), **spec.env("cpu")}
    cmd = [python, __file__, "--child", pair, "--workload", workload_name, "--limit", str(limit),
           "--epochs", str(epochs), "--warmup", str(warmup)]
    return cmd, env


def _table(results: dict[tuple[str, str], list[dict]]) -> None:
    """The side-by-side table (Markdown): per pair and workload, the medians over its processes."""
    print("| pair | workload | samples | adapter | own loop | adapter s/epoch | own s/epoch | adapter / own "
          "| each process's ratio |")
    print("| --- | --- | --: | --- | --- | --: | --: | --: | --- |")
    for (pair, wl), runs in results.items():
        if not runs:
            continue
        med = lambda k: float(np.median([r["steady"][k] for r in runs]))  # noqa: E731
        ratios = [r["ratio"] for r in runs]
        first = runs[0]
        print(f"| {pair} | {wl} | {first['samples']} | `{first['adapter']}` | {first['own']} | {med('adapter'):.3f} "
              f"| {med('own'):.3f} | {float(np.median(ratios)):.3f} | {' '.join(f'{r:.3f}' for r in ratios)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", action="append", choices=list(PAIRS), help="default: every pair")
    ap.add_argument("--workload", action="append", help="default: resnet20 and vit-tiny")
    ap.add_argument("--limit", type=int, help=f"training samples (default per workload: {LIMITS}, x{SLOW} for chainer)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="first epochs left out of the steady median")
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per pair and workload; the median ratio")
    ap.add_argument("--json", help="also write every process's result (per-epoch times) to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier --json files; run nothing")
    args = ap.parse_args()
    workloads = args.workload or ["resnet20", "vit-tiny"]
    if args.table:
        merged: dict[tuple[str, str], list[dict]] = {}
        for f in args.table:
            for r in json.loads(Path(f).read_text()):
                merged.setdefault((r["pair"], r["workload"]), []).append(r)
        _table(dict(sorted(merged.items(), key=lambda kv: (kv[0][1], list(PAIRS).index(kv[0][0])))))
        return
    if args.child:
        print(json.dumps(measure(args.child, workloads[0], args.limit, args.epochs, args.warmup)))
        return
    pairs = args.pair or list(PAIRS)
    results: dict[tuple[str, str], list[dict]] = {(p, wl): [] for wl in workloads for p in pairs}
    for _ in range(args.rounds):
        for wl in workloads:
            for pair in pairs:
                limit = args.limit or int(LIMITS.get(wl, 1024) * SLOW.get(pair, 1.0))
                cmd, env = _child(pair, wl, limit, args.epochs, args.warmup)
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    print(f"{pair} {wl} failed: {(out.stderr.strip().splitlines() or [''])[-1]}", file=sys.stderr)
                    continue
                results[(pair, wl)].append(json.loads(out.stdout.strip().splitlines()[-1]))
                if args.json:  # after every process: a run stopped halfway keeps what it measured
                    Path(args.json).write_text(json.dumps([r for runs in results.values() for r in runs], indent=1))
    _table(results)

if __name__ == "__main__":
    main()
