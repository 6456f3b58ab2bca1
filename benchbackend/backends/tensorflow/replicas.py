"""TensorFlow data parallel: ``tf.distribute.MirroredStrategy`` over N devices of one process (N
logical CPU devices on a CPU, one GPU per replica on a GPU), held to the one semantics of
:mod:`benchbackend.spec.replicas`.

Everything runs in the worker's own process: the model and its optimizer are made under the
strategy's scope (mirrored variables, one copy per device), and a training step is one
``tf.function`` around ``strategy.run``. Forward parity, validation and inference run outside the
strategy, on replica 0's device, as the single-replica adapter does; they read the mirrored
variables' replica-0 copies (equal for the weights; the batchnorm moving statistics, which each
replica updates from its own batch statistics, are replica 0's, as DDP's are).

A step: each replica's shard of the global batch (``_split``: ``replicas.shards``) is given to it
explicitly (``experimental_distribute_values_from_function``, never tf.data's auto-sharding), gathered
once per epoch per replica on that replica's device. The replica's mean loss is weighted by
``replicas.weights`` and divided by N (``_scale``): Keras 3's optimizer under a strategy *sums* the
N gradients (``all_reduce(SUM)`` in ``apply_gradients``), so the sum of the N scaled gradients is
their average, the single-replica step, as ``tf.nn.compute_average_loss`` arranges. The global
loss of a step is the sum of the N scaled losses. The loss is the per-sample crossentropy's mean,
not a ``keras.losses.Loss`` object's, which under a strategy divides by N on its own (Keras'
``scale_loss_for_distribution``, for its own trainer) and would hide the one division the traps
test. BatchNorm keeps Keras' ``synchronized=False``: per-replica batch statistics.

The CPU's logical devices must be configured before TensorFlow's runtime starts: ``__init__`` does
it first (a cell's worker is a fresh process; a preloaded interpreter only imported TensorFlow,
which starts no runtime). TensorFlow has one intra-op thread pool per process, which every logical
CPU device shares, so the pool gets the cell's threads (N times the ``threads`` option, which the
runner splits per replica) and :meth:`threads` reports threads per replica.

``xla``: each replica's forward and backward are compiled by XLA (a nested
``tf.function(jit_compile=True)``, as Keras' own trainer does under a strategy); the all-reduce and
the update stay TensorFlow ops, because MirroredStrategy synchronises through ``merge_call``, which
XLA cannot compile on a CPU.

Tests plant the traps the trajectory check must catch by overriding ``_split`` (overlapping
shards, a dropped remainder), ``_scale`` (summed gradients) or ``_optimizer`` (lr times N).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from ...errors import BackendUnavailable
from ...spec.replicas import shards
from ...spec.replicas import weights as shard_weights
from ...spec.workload import Workload
from ..base import Options, as_options, gpu_index
from ..keras.layers import KerasNet, keras3_optimizer
from .adapter import TensorFlowBackend

_SUM = tf.distribute.ReduceOp.SUM


class TensorFlowMirroredBackend(TensorFlowBackend):
    name = "tensorflow"

    def __init__(self, workload: Workload, device: str, mode: str = "tf.function", precision: str = "fp32",
                 options: "Options | Mapping[str, Any] | None" = None):
        opts = as_options(options)
        #: The number of replicas (one strategy in this process drives them all).
        self.world = opts.replicas or 1
        if workload.next_token:  # issue 37: the single-replica adapter builds decoders; this one not yet
            raise BackendUnavailable("tensorflow: --replicas with a language model (next-token loss and accuracy per "
                                     "position) is not implemented yet")
        if opts.rendezvous:
            raise BackendUnavailable("tensorflow: replicas across processes or nodes are not implemented "
                                     "(MirroredStrategy runs every replica in one process)")
        first = gpu_index(device, self.name)
        if first is None:
            _logical_cpus(self.world)  # before any TensorFlow op, like the threads below
        if opts.threads:  # the runner's threads per replica; the pool is the process's, shared
            opts = replace(opts, threads=opts.threads * self.world)
        super().__init__(workload, device, mode, precision, opts)
        if first is None:
            self.devices = [f"/CPU:{r}" for r in range(self.world)]
        else:
            count = len(tf.config.list_physical_devices("GPU"))
            if first + self.world > count:
                raise BackendUnavailable(f"tensorflow: --replicas {self.world} from GPU {first} needs {self.world} "
                                         f"GPUs (one per replica); tensorflow sees {count}")
            self.devices = [f"/GPU:{first + r}" for r in range(self.world)]
        self.strategy = tf.distribute.MirroredStrategy(self.devices)
        self.replica_data: list[tuple[tf.Tensor, tf.Tensor]] = []
        self._weight_values: dict[tuple[float, ...], Any] = {}

    def details(self) -> dict[str, Any]:
        if self.devices[0].startswith("/CPU"):
            pool = super().threads()
            where = (f"{self.world} logical CPU devices; one intra-op pool of {pool} threads, shared by the "
                     f"replicas")
        else:
            where = f"GPUs {', '.join(d.rpartition(':')[2] for d in self.devices)}"
        return {**super().details(), "replicas": f"{self.world} (MirroredStrategy, {where})"}

    def threads(self) -> int:
        """Threads per replica (the ``threads`` column): the shared intra-op pool over N."""
        return max(1, super().threads() // self.world)

    def gemm_peak(self, precision: str) -> float:
        """One replica's peak. On a GPU, replica 0's. On a CPU the probe's matmuls run on the one
        pool of N replicas' threads, while the peak cache is keyed by threads per replica
        (:meth:`threads`): the rate stored is the pool's over N."""
        rate = super().gemm_peak(precision)
        return rate / self.world if self.devices[0].startswith("/CPU") else rate

    # --- model ------------------------------------------------------------------------------
    def _optimizer(self, net: KerasNet) -> Any:
        """The workload's optimizer for ``net``, built; called under the strategy's scope."""
        opt = keras3_optimizer(keras, self.workload, net)
        opt.build(net.model.trainable_variables)
        return opt

    def build(self, weights: Sequence[np.ndarray]) -> int:
        with self.strategy.scope():
            self.net = self._net()
            self.model = self.net.model
            self.net.set(weights)  # in the cross-replica context: every replica's copy
            self.opt = self._optimizer(self.net)
            self.loss_fn = keras.losses.CategoricalCrossentropy()
        _, self._predict_step = self._compile_steps(self.model, self.opt)  # replica 0's device
        self._train_step = self._distributed_step(self.model, self.opt)
        return int(sum(int(np.prod(v.shape)) for v in self.model.weights))

    def _scale(self, loss: tf.Tensor) -> tf.Tensor:
        """A replica's weighted loss as it enters the gradient: over N, since the optimizer sums the
        N replicas' gradients. (The step's reported loss is divided apart, so that a trap planted
        here shows in the trajectory through the update alone.)"""
        return loss / self.world

    def _distributed_step(self, model: keras.Model, opt: Any) -> Any:
        """One global step: ``(x, y, weight)`` per replica in, (global loss, hits) out."""
        nc, strategy = self.workload.num_classes, self.strategy

        def gradients(x, y, weight):
            with tf.GradientTape() as tape:
                probs = tf.cast(model(x, training=True), tf.float32)
                # Per sample, then the mean: a keras.losses.Loss object called under a strategy would
                # divide by N itself (scale_loss_for_distribution), out of sight of _scale.
                loss = tf.reduce_mean(keras.losses.categorical_crossentropy(tf.one_hot(y, nc), probs)) * weight
                if model.losses:  # the L2 kernel regularizers, whole on every replica (averaged: once)
                    loss = loss + tf.add_n([tf.cast(v, tf.float32) for v in model.losses])
                scaled = self._scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            hits = tf.reduce_sum(tf.cast(tf.argmax(probs, 1) == y, tf.int32)) * tf.cast(weight > 0, tf.int32)
            return loss / self.world, hits, grads  # the replica's share of the global batch's loss

        if self.jit:
            gradients = tf.function(gradients, jit_compile=True)

        def replica_step(x, y, weight):
            loss, hits, grads = gradients(x, y, weight)
            opt.apply_gradients(zip(grads, model.trainable_variables))  # all-reduce (sum), then the update
            return loss, hits

        @tf.function
        def train_step(x, y, weight):
            loss, hits = strategy.run(replica_step, args=(x, y, weight))
            return strategy.reduce(_SUM, loss, axis=None), strategy.reduce(_SUM, hits, axis=None)

        return train_step

    def _split(self, size: int) -> list[tuple[int, int, float]]:
        """(start, stop, weight) of each replica's share of a global batch of ``size`` (``replicas``)."""
        return [(a, b, w) for (a, b), w in zip(shards(size, self.world), shard_weights(size, self.world))]

    def _per_replica(self, values: Sequence[Any]) -> Any:
        """One value per replica, as the strategy's distributed value (replica r gets ``values[r]``)."""
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: values[ctx.replica_id_in_sync_group])

    def _weights(self, ws: Sequence[float]) -> Any:
        """The replicas' loss weights as a distributed value (one per distinct set: made once)."""
        key = tuple(ws)
        if key not in self._weight_values:
            values = []
            for device, w in zip(self.devices, ws):
                with tf.device(device):
                    values.append(tf.constant(w, tf.float32))
            self._weight_values[key] = self._per_replica(values)
        return self._weight_values[key]

    # --- data -------------------------------------------------------------------------------
    def _replica_held(self, r: int) -> str:
        """Where replica r's training arrays are: its device, or the host (``data_on_device``)."""
        return self.devices[r] if self.data_on_device else "/CPU:0"

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        super().set_data(x_train, y_train)
        self.replica_data = [(self.x_train, self.y_train)]
        for r in range(1, self.world):  # each replica holds the arrays (logical CPU devices share the buffer)
            with tf.device(self._replica_held(r)):
                self.replica_data.append((tf.identity(self.x_train), tf.identity(self.y_train)))

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[tf.Tensor, tf.Tensor]:
        bs, n = self.workload.training.batch_size, len(order)
        plan = []  # per global batch: its size, its first sample, and (start, stop, weight) per replica
        for start in range(0, n, bs):
            size = min(bs, n - start)
            plan.append((size, int(order[start]), [(start + a, start + b, w) for a, b, w in self._split(size)]))
        epoch = []  # per replica: the epoch's shards gathered once on its device, then sliced
        for r, (x_all, y_all) in enumerate(self.replica_data):
            idx = np.concatenate([order[s[r][0]:s[r][1]] for _, _, s in plan]).astype(np.int64)
            with tf.device(self._replica_held(r)):
                ids = tf.constant(idx)
                epoch.append((tf.gather(x_all, ids), tf.gather(y_all, ids)))
        pos = [0] * self.world
        losses, correct = [], []
        for _, first, spans in plan:
            xs, ys = [], []
            for r, (a, b, _) in enumerate(spans):
                with tf.device(self._replica_held(r)):
                    if b > a:
                        xs.append(epoch[r][0][pos[r]:pos[r] + b - a])
                        ys.append(epoch[r][1][pos[r]:pos[r] + b - a])
                    else:  # fewer samples than replicas: a zero-weighted stand-in joins the average
                        stand_in = tf.constant([first, first], tf.int64)
                        xs.append(tf.gather(self.replica_data[r][0], stand_in))
                        ys.append(tf.gather(self.replica_data[r][1], stand_in))
                pos[r] += b - a
            ws = [w if b > a else 0.0 for a, b, w in spans]
            loss, hits = self._train_step(self._per_replica(xs), self._per_replica(ys), self._weights(ws))
            losses.append(loss)
            correct.append(hits)
        with tf.device(self.devices[0]):
            sizes = tf.constant([size for size, _, _ in plan], tf.float32)
            mean_loss = tf.reduce_sum(tf.stack(losses) * sizes) / n
            acc = tf.cast(tf.reduce_sum(tf.stack(correct)), tf.float32) / n
        return mean_loss, acc  # the global epoch's, on replica 0's device

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        # A twin without dropout, with its own optimizer: the worker builds afresh afterwards.
        with self.strategy.scope():
            twin = self._net(dropout=False)
            twin.set(self.net.get())
            opt = self._optimizer(twin)
        step = self._distributed_step(twin.model, opt)
        losses = []
        for x, y in batches:
            x, y = np.asarray(x, np.float32), np.asarray(y, np.int64)
            xs, ys, ws = [], [], []
            for device, (a, b, w) in zip(self.devices, self._split(len(x))):
                rows = slice(a, b) if b > a else [0, 0]  # [0, 0]: a zero-weighted stand-in (see train_epoch)
                with tf.device(device):
                    xs.append(tf.constant(x[rows]))
                    ys.append(tf.constant(y[rows]))
                ws.append(w if b > a else 0.0)
            loss, _ = step(self._per_replica(xs), self._per_replica(ys), self._weights(ws))
            losses.append(float(loss.numpy()))
        return losses


def _logical_cpus(n: int) -> None:
    """Split the host CPU into ``n`` logical devices, one per replica. TensorFlow allows it only
    before its runtime starts; a process whose runtime already runs with ``n`` of them is fine."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < n:
            raise BackendUnavailable(f"tensorflow: --replicas {n} needs {n} logical CPU devices, but TensorFlow's "
                                     f"runtime already started in this process with {have}") from None
