"""Data parallel (``--replicas N``): the one semantics every backend's engine is held to.

- ``batch_size`` is the *global* batch. Each global batch is the single-replica run's batch (the
  same samples of the same epoch order); replica r takes the contiguous slice r of it
  (:func:`shards`), so the N slices of a global batch are disjoint and cover it.
- A global batch not divisible by N is a usage error (exit 2) before anything runs
  (:func:`check_batches`): a full batch is always split evenly, ``batch_size / N`` per replica.
- The last global batch of an epoch may be short (``L`` samples, fewer than ``batch_size``); it is
  neither dropped nor padded. It is split as evenly as possible (the first ``L % N`` replicas take
  one sample more), and each replica's mean loss is weighted by ``N * n_r / L`` (:func:`weights`)
  before the engine averages the gradients over the N replicas: the average is then exactly the
  gradient of the mean loss over the L samples, the single-replica step. (A full batch weighs 1.)
  A replica left without a sample (L < N) joins the average with a zero-weighted stand-in.
- Gradients are averaged (DDP's allreduce mean), never summed.
- The learning rate is the workload's, unchanged. ``--scale-lr linear`` multiplies it by N (the
  usual large-batch rule), as the user's explicit choice, recorded in the ``scale_lr`` column; the
  trajectory check then holds the run to the reference at that learning rate.
- BatchNorm uses per-replica batch statistics in training steps, as DDP without SyncBN does; the
  moving statistics are replica 0's (DDP broadcasts its buffers at each forward), which the
  validation and inference passes use. The reference a batchnorm network's replica run is checked
  against computes the batch statistics per shard too (``run.truth.sharded_losses``).
- ``--scaling weak`` fixes the per-replica batch instead: N replicas train a global batch of N times
  ``batch_size`` (:func:`scaled`), with the same rules. Strong and weak cells are never one group in
  ``compare`` (``scaling`` column), and their single-replica cell is the same.
- On a CPU the cell's cores (``--threads``, default all) are split between the replicas
  (:func:`threads_per_replica`); the ``threads`` column records threads per replica.
- Timing: replica 0 runs in the cell's worker and reports the rows; an epoch's time is the wall
  time until every replica has finished its last step (the epoch's totals are all-reduced). The
  passes replica 0 runs alone (forward parity, validation, inference) use all the cell's threads.

Nothing here imports a framework: the plan, the CLI, the reference and the adapters share it.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ..errors import WorkloadError

SCALE_LR = ("none", "linear")
#: ``--scaling``: strong keeps the global batch (split over the replicas); weak keeps each replica's
#: batch at the workload's, so N replicas train a global batch N times as large.
SCALING = ("strong", "weak")


def shards(size: int, replicas: int) -> list[tuple[int, int]]:
    """(start, stop) of each replica's contiguous slice of a global batch of ``size`` samples: as
    even as possible, the first ``size % replicas`` replicas one sample more."""
    base, extra = divmod(size, replicas)
    bounds = [0]
    for r in range(replicas):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def weights(size: int, replicas: int) -> list[float]:
    """Each replica's weight on its mean loss, ``N * n_r / size``, so that the engine's average of
    the N gradients is the gradient of the mean over the whole global batch."""
    return [replicas * (stop - start) / size for start, stop in shards(size, replicas)]


def check_batches(workloads: Sequence[Any], replicas: Sequence[int], scaling: str = "strong") -> None:
    """Raise ``WorkloadError`` when a workload's global batch does not split evenly over a ``--replicas``
    (under weak scaling it is N times the per-replica batch, which always does)."""
    for w in workloads if scaling == "strong" else []:
        bs = w.training.batch_size
        for n in replicas:
            if bs % n:
                raise WorkloadError(f"{w.name}: batch size {bs} does not split evenly over --replicas {n}; "
                                    f"use a --batch-size divisible by {n}")


def threads_per_replica(threads: Optional[int], replicas: int) -> Optional[int]:
    """Intra-op threads of each replica: the cell's (``--threads``, default every core) split evenly,
    at least 1; None (the backend's default) for one replica without ``--threads``."""
    if replicas <= 1:
        return threads
    return max(1, (threads or os.cpu_count() or 1) // replicas)


def oversubscribed(replicas: Sequence[int], threads: Optional[int], device: str, cores: Optional[int]) -> list[str]:
    """What a CPU run of more replicas than threads makes doubtful, said before it starts: each
    replica still gets a thread (:func:`threads_per_replica`), so they contend for the cores and the
    efficiency measures that contention."""
    budget = threads or cores or 1
    many = [n for n in dict.fromkeys(replicas) if n > budget]
    if device != "cpu" or not many:
        return []
    return [f"--replicas {n} on {budget} CPU threads: each replica still takes one, so {n} threads contend for "
            f"{budget} and the scaling measures that contention" for n in many]


def scaled(workload: Any, replicas: int, scale_lr: str, scaling: str = "strong") -> Any:
    """The workload as the replicas train it: its learning rate times N under ``--scale-lr linear``,
    its (global) batch times N under ``--scaling weak``. The rows keep the workload's own definition
    (hash, ``batch_size``), so that a cell of N replicas is compared with the single replica's."""
    if replicas <= 1 or (scale_lr != "linear" and scaling != "weak"):
        return workload
    t = workload.training
    update = {"lr": t.lr * replicas} if scale_lr == "linear" else {}
    if scaling == "weak":
        update["batch_size"] = t.batch_size * replicas
    return workload.model_copy(update={"training": t.model_copy(update=update)})
