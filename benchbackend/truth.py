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

_SOURCES = ("backends/reference.py", "backends/_numpy_ops.py", "model.py", "graph.py", "layers.py")


def _key(workload: Any, weights: Sequence[np.ndarray], batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for name in _SOURCES:
        digest.update((root / name).read_bytes())
    spec = workload.model_dump(mode="json", include={"model", "training"})
    digest.update(json.dumps([spec, workload.num_classes], sort_keys=True).encode())
    for array in (*weights, *(a for batch in batches for a in batch)):
        a = np.ascontiguousarray(array)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()[:32]


def trajectory(workload: Any, weights: Sequence[np.ndarray],
               batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """The reference's float64 loss of each of ``len(batches)`` training steps from ``weights``,
    dropout off (``reference.train_losses``), from the cache when it holds them."""
    from .backends import reference
    from .paths import cache_dir

    path = cache_dir() / "reference" / f"{_key(workload, weights, batches)}.json"
    try:
        return [float(v) for v in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass
    losses = [float(v) for v in reference.train_losses(workload, weights, batches, dtype=np.float64)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(losses))
        os.replace(tmp, path)
    except OSError:
        pass
    return losses
