"""Keras 3 on JAX, data parallel: ``keras.distribution.DataParallel`` over N JAX devices, held to the
one semantics of :mod:`benchbackend.spec.replicas`.

DataParallel is SPMD: one process, one program, the model's variables replicated on a 1-D mesh of
N devices and every batch one *global* array sharded on its batch axis (replica r holds the
contiguous slice r: XLA's even split of a ``NamedSharding``). The loss is Keras' mean over the
global batch, so XLA's gradient of it is the average of the N shards' gradients (the all-reduce
DDP does by hand) and each global step is the single-replica step, lr unchanged. On a CPU the N
devices are XLA's CPU devices (``jax_num_cpu_devices``); on a GPU, N GPUs from ``--device``'s.

What SPMD changes, each stated here once:

- **A shard's size must divide the batch.** A global batch of L samples with ``L % N != 0`` (only
  an epoch's short last batch: ``check_batches`` makes the full ones divide) is fed padded to the
  next multiple P of N with copies of its first samples, weighted 0, its L samples weighted
  ``P / L`` (``_feed``): Keras' ``sum_over_batch_size`` divides the weighted sum by P, so the loss
  and its gradient are the mean over the L samples, the single-replica step. Keras' loss tracker
  weighs a batch by its padded size, so such a batch is trained by ``train_on_batch`` after the
  epoch's ``fit`` over the others, and the epoch's totals are combined here by samples. The shards
  of a padded batch are not ``replicas.shards``' (the pads sit in the last shard); the step is the
  same, which is what the semantics hold every engine to.
- **Batchnorm would be synchronized.** A batchnorm layer's mean over the batch axis of a sharded
  array is the global batch's: synchronized batchnorm, not the per-replica statistics of DDP
  without SyncBN that ``--replicas`` specifies (and pads would enter the statistics). Such a
  cell is ``unavailable``, saying so.
- **No per-replica code.** Slicing, the gradients' reduction and the optimizer step are XLA's,
  from the shardings: overlapping slices or a gradient sum cannot be written here. What can go
  wrong is the global batch fed and its loss's scale (``_feed``) and the optimizer
  (``_compiled``): the tests plant their traps there.

Forward parity, validation and inference run the same replicated model through ``predict``,
each batch sharded over the N devices (padded like a training batch where it does not divide, the
pads' rows dropped from the output). The arrays stay where the base puts them (JAX's default device,
the mesh's first); Keras reshards each batch over the mesh (``device_put``), a copy of (N-1)/N of
the batch inside the clock, as any single-host pipeline feeding DataParallel pays.

JAX's CPU devices must be counted before JAX's CPU backend starts, which is the first thing
``__init__`` does. The preloaded interpreter a CPU cell is forked from (``preload.py``) has imported
this module, and with it keras and jax, which starts no backend, so a forked worker still can.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import keras
import numpy as np

from ...errors import BackendUnavailable
from ...spec.workload import Workload
from ..base import Options, as_options
from .adapter import KerasJaxBackend
from .layers import KerasNet


def count_cpu_devices(n: int, backend: str) -> None:
    """Ask XLA for ``n`` CPU devices; ``BackendUnavailable`` when JAX's CPU backend has already
    started with fewer (this process ran JAX before the adapter was made)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have < n:
            raise BackendUnavailable(f"{backend}: JAX's CPU backend started with {have} device(s) before "
                                     f"--replicas {n} could ask for {n}; run the cell in a fresh worker") from None


def padded(size: int, n: int) -> int:
    """The smallest multiple of ``n`` that holds ``size`` samples (at least ``n``)."""
    return max(n, -(-size // n) * n)


class _Fed(keras.utils.PyDataset):
    """The first ``batches`` global batches of ``x, y`` (consecutive slices of ``batch_size``), each
    as ``feed`` gives it to Keras."""

    def __init__(self, x: Any, y: Any, batch_size: int, batches: int, feed: Any):
        super().__init__()
        self.x, self.y, self.batch_size, self.batches, self.feed = x, y, batch_size, batches, feed

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        start = i * self.batch_size
        return self.feed(self.x[start:start + self.batch_size], self.y[start:start + self.batch_size])


class _Inputs(keras.utils.PyDataset):
    """Consecutive slices of ``batch_size`` of ``x``, each padded to a multiple of ``n`` samples."""

    def __init__(self, x: Any, batch_size: int, n: int):
        super().__init__()
        self.x, self.batch_size, self.n = x, batch_size, n

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i: int) -> tuple[Any]:
        xb = self.x[i * self.batch_size:(i + 1) * self.batch_size]
        return (_pad(xb, padded(len(xb), self.n)),)


def _pad(a: Any, size: int) -> Any:
    """``a`` followed by copies of its first rows, ``size`` rows in all (``a`` itself if it has them)."""
    extra = size - len(a)
    if extra <= 0:
        return a
    rows = np.arange(extra) % len(a)
    if isinstance(a, np.ndarray):
        return np.concatenate([a, a[rows]])
    return keras.ops.concatenate([a, keras.ops.take(a, keras.ops.convert_to_tensor(rows.astype(np.int32)), axis=0)])


class KerasJaxDataParallelBackend(KerasJaxBackend):
    name = "keras-jax"

    def __init__(self, workload: Workload, device: str, mode: str = "fit", precision: str = "fp32",
                 options: "Options | Mapping[str, Any] | None" = None):
        opts = as_options(options)
        #: The number of replicas: devices of the mesh.
        self.world = opts.replicas or 1
        if workload.next_token:  # issue 37: the single-replica adapter builds decoders; this one not yet
            raise BackendUnavailable("keras-jax: --replicas with a language model (next-token loss and accuracy per "
                                     "position) is not implemented yet")
        if opts.rendezvous:
            raise BackendUnavailable("keras-jax: replicas in processes of their own (Ray Train) are not implemented: "
                                     "keras.distribution.DataParallel here runs N devices of one process")
        if any(layer.type == "batchnorm" for layer in workload.model):
            raise BackendUnavailable(f"keras-jax: --replicas {self.world} on a batchnorm network: "
                                     "keras.distribution.DataParallel computes batch statistics over the global "
                                     "batch (synchronized), not per replica as --replicas specifies")
        if device == "cpu":
            count_cpu_devices(self.world, "keras-jax")  # before anything starts JAX's CPU backend
        super().__init__(workload, device, mode, precision, opts)
        found = jax.devices(self._dev.platform)
        mesh = found[found.index(self._dev):][:self.world]  # --device's and the next N - 1
        if len(mesh) < self.world:
            raise BackendUnavailable(f"keras-jax: --replicas {self.world} from {self.device} needs {self.world} "
                                     f"{self._dev.platform} devices (one per replica); jax sees {len(found)}")
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=mesh))

    def details(self) -> dict[str, Any]:
        # The devices a built model's variables really live on, not the number asked for.
        held = len(self.model.weights[0].value.sharding.device_set) if self.model is not None else 0
        return {**super().details(), "replicas": f"{self.world} (keras.distribution.DataParallel over {held} "
                                                 f"{self._dev.platform.upper()} devices)"}

    # --- the global batch as Keras gets it -----------------------------------------------------
    def _feed(self, x: Any, y: Any) -> tuple[Any, ...]:
        """One global batch for ``fit``/``train_on_batch``: as it is when N divides it, else padded to
        the next multiple P of N with its first samples weighted 0 and its own weighted ``P / L``."""
        size = len(x)
        if size % self.world == 0:
            return x, y
        total = padded(size, self.world)
        weights = np.zeros(total, np.float32)
        weights[:size] = total / size
        return _pad(x, total), _pad(y, total), weights

    # --- training -------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        assert self.model is not None
        x, y = self.epoch_arrays(order)
        bs, n = self.workload.training.batch_size, len(order)
        last = n % bs  # the short last batch's samples (0: there is none)
        padded_last = last if last % self.world else 0
        fitted = n - padded_last
        loss = acc = 0.0
        if fitted:
            history = self.model.fit(_Fed(x, y, bs, -(-fitted // bs), self._feed), epochs=1, shuffle=False,
                                     verbose=0)
            # Means over samples, each batch weighted by its size: the fitted batches are unpadded.
            loss += float(history.history["loss"][-1]) * fitted
            acc += float(history.history["accuracy"][-1]) * fitted
        if padded_last:
            logs = self.model.train_on_batch(*self._feed(x[fitted:], y[fitted:]), return_dict=True)
            loss += float(logs["loss"]) * padded_last
            acc += float(logs["accuracy"]) * padded_last
        return loss / n, acc / n

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        assert self.net is not None
        twin = self._compiled(False, self.net.get())  # no dropout layers, a fresh optimizer (see the base)
        return [float(twin.model.train_on_batch(*self._feed(np.asarray(xb, np.float32), np.asarray(yb, np.int32)),
                                                return_dict=True)["loss"]) for xb, yb in batches]

    def _compiled(self, dropout: bool, weights: Sequence[np.ndarray]) -> KerasNet:
        """The base's model, its accuracy compiled as a *weighted* metric: Keras' plain ``metrics``
        ignore sample weights, so a padded batch's pads would count as samples."""
        net = super()._compiled(dropout, weights)
        net.model.compile(optimizer=net.model.optimizer, loss=net.model.loss,
                          weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
        return net

    # --- inference -----------------------------------------------------------------------------
    def scores(self, x: Any, batch_size: int) -> np.ndarray:
        assert self.model is not None
        if len(x) == 0 or (batch_size % self.world == 0 and len(x) % batch_size % self.world == 0):
            return super().scores(x, batch_size)
        out = self.model.predict(_Inputs(x, batch_size, self.world), verbose=0)
        real = [min(batch_size, len(x) - start) for start in range(0, len(x), batch_size)]
        keep = np.concatenate([np.arange(padded(n, self.world)) < n for n in real])  # the pads' rows go
        return out[keep]
