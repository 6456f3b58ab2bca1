"""The reference's float64 training trajectory, cached on disk: the ground truth of ``--parity-steps``.

The first K losses of the NumPy reference in float64 are the same for every backend, mode and
repeat that shares the workload's model and training settings, its initial weights and its
batches, and they are expensive (20 Adam steps of the cifar10 CNN take about half a minute of one
core). So they are computed once and kept in ``paths.cache_dir() / "reference"``, under a digest of
everything they depend on: the reference's own source (a fix to the reference is a new key), the
model and training settings, the weights and the batches. A cache that cannot be written only costs
the computation again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

_SOURCES = ("backends/numpy/reference.py", "backends/numpy/ops.py", "backends/numpy/transformer.py", "run/truth.py",
            "spec/model.py", "spec/graph.py", "spec/layers.py")


def _key(workload: Any, weights: Sequence[np.ndarray], batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent  # the package
    for name in _SOURCES:
        digest.update((root / name).read_bytes())
    spec = workload.model_dump(mode="json", include={"model", "training"})
    digest.update(json.dumps([spec, workload.num_classes], sort_keys=True).encode())
    for array in (*weights, *(a for batch in batches for a in batch)):
        a = np.ascontiguousarray(array)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()[:32]


def _cached(key: str, compute: Any) -> Any:
    """``compute()`` (JSON-able), kept under ``key`` in the cache; read back when it is there."""
    from ..paths import cache_dir

    path = cache_dir() / "reference" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


def trajectory(workload: Any, weights: Sequence[np.ndarray],
               batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """The reference's float64 loss of each of ``len(batches)`` training steps from ``weights``,
    dropout off (``reference.train_losses``), from the cache when it holds them."""
    from ..backends.numpy import reference

    def compute() -> list[float]:
        return [float(v) for v in reference.train_losses(workload, weights, batches, dtype=np.float64)]

    return [float(v) for v in _cached(_key(workload, weights, batches), compute)]


def _recompute(workload: Any, weights: Any, prompts: np.ndarray, steps: int,
             dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Greedy generation, the definition every backend's cached decoding is held to: ``steps`` new
    tokens after each prompt (``prompts``: (B, P) token ids), each the argmax of the network's output
    at the last position, recomputed over the whole sequence so far (no key/value cache: nothing to
    get wrong). Returns ``(ids, gaps)``, each (B, steps): the generated ids, and at each step the
    top two outputs' gap relative to the top one, ``(p1 - p2) / p1`` (what decides a tie,
    ``checks.generation``)."""
    from ..backends.numpy.reference import network

    net = network(workload, [np.array(w, dtype) for w in weights])
    seq = np.asarray(prompts, dtype)
    ids, gaps = [], []
    for _ in range(steps):
        last = np.asarray(net.forward(seq)[:, -1], np.float64)  # (B, vocab): probabilities
        top2 = np.sort(last, axis=-1)[:, -2:]
        nxt = last.argmax(axis=-1)
        ids.append(nxt)
        gaps.append((top2[:, 1] - top2[:, 0]) / np.maximum(top2[:, 1], 1e-300))
        seq = np.concatenate([seq, nxt[:, None].astype(dtype)], axis=1)
    return np.stack(ids, axis=1).astype(np.int64), np.stack(gaps, axis=1)



def greedy(workload: Any, weights: Sequence[np.ndarray], prompts: np.ndarray, steps: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """The reference's float64 greedy generation (``_recompute``): ``(ids, gaps)``, each
    (B, steps), from the cache when it holds them (gpt2-124m's 32 steps take a minute)."""
    prompts = np.asarray(prompts, np.float32)

    def compute() -> dict[str, list]:
        ids, gaps = _recompute(workload, weights, prompts, steps)
        return {"ids": ids.tolist(), "gaps": gaps.tolist()}

    key = "greedy-" + _key(workload, weights, [(prompts, np.asarray([steps]))])
    got = _cached(key, compute)
    return np.asarray(got["ids"], np.int64).reshape(len(prompts), steps), \
        np.asarray(got["gaps"], np.float64).reshape(len(prompts), steps)


def sharded_losses(workload: Any, weights_: Sequence[np.ndarray], batches: Sequence[tuple[np.ndarray, np.ndarray]],
                   replicas: int) -> list[float]:
    """The float64 reference trajectory of N replicas of a batchnorm network: each global batch's
    shards go through the reference separately (batch statistics per shard), their losses and
    gradients weighted by ``n_r / L`` and summed (the engine's average of the weighted gradients),
    then one update (``reference.update``). Without batchnorm this equals the single-replica trajectory."""
    from ..backends.numpy import ops, reference
    from ..spec.replicas import shards

    net = reference.network(workload, [np.array(w, np.float64) for w in weights_])
    optimizer = ops.make_optimizer(workload.training)
    out = []
    for x, y in batches:
        loss, grads = 0.0, None
        for start, stop in shards(len(x), replicas):
            if stop == start:
                continue
            share = (stop - start) / len(x)
            y1 = ops.one_hot(np.asarray(y[start:stop], np.int64), workload.num_classes, np.float64)
            part, g, _ = net.loss_and_grads(np.asarray(x[start:stop], np.float64), y1)
            loss += share * float(part)
            grads = [share * gi for gi in g] if grads is None else [a + share * gi for a, gi in zip(grads, g)]
        reference.update(net, optimizer, grads, workload.training)
        out.append(loss)
    return out
