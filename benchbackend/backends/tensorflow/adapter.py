"""TensorFlow adapter: a Keras 3 model trained by a compiled ``tf.function`` step over in-memory tensors.

Modes: ``tf.function`` (graph step, TF's own kernels) and ``xla`` (the same steps with
``jit_compile=True``). Precisions: ``fp32`` (strict: TF32 off, see ``precision.py``); ``tf32`` (an
Ampere or newer GPU); ``bf16`` through Keras' ``mixed_bfloat16`` policy, per layer (float32
variables, bfloat16 compute; the final softmax and the loss in float32; a decoder's attention
softmax and RMSNorm in float32 too, ``keras/decoder.py``). A language model's loss is the mean
over every position (N*T) and its accuracy the share of positions predicted; ``--replicas`` with
one is not built yet (``replicas.py`` says unavailable).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from ...errors import BackendUnavailable
from ...spec.workload import Workload
from ..base import Backend, gemm_rate, gpu_index
from ..keras.generation import KerasGeneration
from ..keras.layers import KerasNet, keras3_build, keras3_optimizer
from ..precision import capability_of, check_tf32, math_mode

_POLICY = {"fp32": "float32", "tf32": "float32", "bf16": "mixed_bfloat16"}


class _PolicyLayers:
    """``keras.layers`` whose layers are made under one dtype policy (no global policy is set,
    so nothing leaks to other models in the process)."""

    def __init__(self, policy: str):
        self.policy = policy

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(keras.layers, name), dtype=self.policy)


class TensorFlowBackend(KerasGeneration, Backend):
    """Generation: the Keras family's cached forward (``keras/generation.py``) in ``tf.function``s
    on this device, under the model's dtype policy, XLA in the ``xla`` mode."""

    name = "tensorflow"

    def __init__(self, workload: Workload, device: str, mode: str = "tf.function", precision: str = "fp32",
                 options: Mapping[str, Any] | None = None):
        super().__init__(workload, device, mode, precision, options)
        threads = self.options.threads
        if threads:  # must precede any TensorFlow op
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
            tf.config.threading.set_inter_op_parallelism_threads(int(threads))
        index = gpu_index(device, self.name)
        if index is None:
            self.device = "/CPU:0"
        else:
            gpus = tf.config.list_physical_devices("GPU")
            if not gpus:
                raise BackendUnavailable("tensorflow sees no GPU (tf.config.list_physical_devices('GPU') is empty); "
                                         "use --device cpu, or install `tensorflow[and-cuda]` on a CUDA machine")
            if index >= len(gpus):
                raise BackendUnavailable(f"tensorflow sees {len(gpus)} GPU(s); there is no GPU {index}")
            self.device = f"/GPU:{index}"
        if precision not in _POLICY:
            raise BackendUnavailable(f"tensorflow: precision '{precision}' is not supported; use fp32, tf32 or bf16")
        if precision == "tf32":
            details = self._gpu_details()
            check_tf32(self.name, details.get("device_name", "gpu") if details is not None else None,
                       capability_of(details.get("compute_capability")) if details is not None else None)
        # TF32 is on by default on Ampere+ GPUs: the precision rule (precision.py) sets it either way.
        tf.config.experimental.enable_tensor_float_32_execution(precision == "tf32")
        self.math = math_mode(precision)
        self.policy = _POLICY[precision]
        self.jit = mode == "xla"

    @classmethod
    def probe(cls) -> dict:
        devices = [d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()]
        return {"version": tf.__version__, "devices": devices}

    def version(self) -> str:
        return tf.__version__

    def device_id(self) -> str:
        return self.device.strip("/").lower()

    def _gpu_details(self) -> dict[str, Any] | None:
        """TensorFlow's details of the GPU in use (name, compute capability); None on the CPU."""
        if not self.device.startswith("/GPU"):
            return None
        gpu = tf.config.list_physical_devices("GPU")[int(self.device.rpartition(":")[2])]
        return dict(tf.config.experimental.get_device_details(gpu))

    def gpu_name(self) -> str:
        details = self._gpu_details()
        return "" if details is None else str(details.get("device_name", "gpu"))

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype_policy": self.policy} if self.policy != "float32" else {}
        if self.device.startswith("/GPU"):
            out["cudnn_autotune"] = "on" if os.environ.get("TF_CUDNN_USE_AUTOTUNE", "1") != "0" else "off"
        return out

    # --- model ------------------------------------------------------------------------------
    def _net(self, dropout: bool = True) -> KerasNet:
        # Keras' mixed-precision advice: the output softmax in float32, so that the probabilities
        # and the loss are not rounded to bfloat16's 8 bits.
        if self.policy == "float32":
            return keras3_build(self.workload, keras, dropout=dropout)
        return keras3_build(self.workload, keras, _PolicyLayers(self.policy), dtype=self.policy, dropout=dropout,
                            output_dtype="float32")

    def build(self, weights: Sequence[np.ndarray]) -> int:
        with tf.device(self.device):
            self.net = self._net()
            self.model = self.net.model
            self.net.set(weights)  # Keras' own layouts are the canonical ones
            self.opt = keras3_optimizer(keras, self.workload, self.net)
            self.opt.build(self.model.trainable_variables)
            self.loss_fn = keras.losses.CategoricalCrossentropy()
        self._train_step, self._predict_step = self._compile_steps(self.model, self.opt)
        self._twin: Any = None
        return int(sum(int(np.prod(v.shape)) for v in self.model.weights))

    def _compile_steps(self, model: keras.Model, opt: Any) -> tuple[Any, Any]:
        nc, loss_fn = self.workload.num_classes, self.loss_fn
        # No input_signature: each batch shape (full, and the last short one) gets its own trace
        # with static shapes, which TF's CPU kernels run measurably faster (5-9% on cifar10) than
        # a single trace with an unknown batch dimension (and XLA compiles static shapes only).
        @tf.function(jit_compile=self.jit)
        def train_step(x, y):
            with tf.GradientTape() as tape:
                probs = tf.cast(model(x, training=True), tf.float32)
                loss = loss_fn(tf.one_hot(y, nc), probs)
                if model.losses:  # the L2 kernel regularizers, as Keras' fit adds them
                    loss = loss + tf.add_n([tf.cast(v, tf.float32) for v in model.losses])
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            # Returned, not accumulated in variables: assign_add adds ordering constraints
            # that cost 3-5% of a cifar10 step on CPU.
            # Hits per sample: a language model's samples have T positions each (labels (N, T)).
            hits = tf.reduce_sum(tf.cast(tf.argmax(probs, -1) == y, tf.int32))
            return loss, tf.cast(hits, tf.float32) / float(np.prod(y.shape[1:]))

        @tf.function(jit_compile=self.jit)
        def predict_step(x):
            return tf.cast(model(x, training=False), tf.float32)

        return train_step, predict_step

    def _no_dropout_twin(self) -> KerasNet:
        """The network without dropout layers, on the current weights (batchnorm in training mode
        then runs without dropout: the trajectory check and the training-mode parity)."""
        with tf.device(self.device):
            twin = self._net(dropout=False)
            twin.set(self.net.get())
        return twin

    def get_weights(self) -> list[np.ndarray]:
        return [np.asarray(w) for w in self.net.get()]

    def threads(self) -> int:
        return tf.config.threading.get_intra_op_parallelism_threads() or (os.cpu_count() or 1)

    def _generation_options(self) -> dict[str, Any]:
        return {"device": self.device, "jit": self.jit}

    # --- data -------------------------------------------------------------------------------
    # An eager tensor made under tf.device is copied to that device (int64 labels too; TF keeps
    # only int32 in host memory on a GPU). With ``data_on_device`` the arrays live on the device and
    # an epoch gathers and slices them there; without it they stay on the host (``_held``), are
    # sliced there, and each batch is copied to the device by the step, inside the clock.
    def _held(self) -> str:
        return self.device if self.data_on_device else "/CPU:0"

    def to_device(self, x: np.ndarray) -> tf.Tensor:
        with tf.device(self._held()):
            return tf.constant(x, tf.float32)

    def take(self, x: tf.Tensor, indices: np.ndarray) -> tf.Tensor:
        with tf.device(self._held()):
            return tf.gather(x, indices)

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        with tf.device(self._held()):
            self.x_train = tf.constant(x_train, tf.float32)
            self.y_train = tf.constant(y_train, tf.int64)

    def to_host(self, value: Any) -> Any:
        return value.numpy() if hasattr(value, "numpy") else np.asarray(value)

    def sync(self) -> None:
        """Wait for every device: TensorFlow's eager ops return before a GPU (or an async executor)
        has run them. ``sync_devices`` (TF 2.14 and later; the extra needs 2.16) runs a SyncDevice
        op on each device and waits for the executor, on a CPU too."""
        tf.test.experimental.sync_devices()

    def peak_device_mb(self) -> float | None:
        if not self.device.startswith("/GPU"):
            return None  # TensorFlow keeps no memory statistics for a CPU
        return tf.config.experimental.get_memory_info(self.device.strip("/"))["peak"] / 2**20

    def reset_device_peak(self) -> None:
        if self.device.startswith("/GPU"):
            tf.config.experimental.reset_memory_stats(self.device.strip("/"))

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[tf.Tensor, tf.Tensor]:
        bs = self.workload.training.batch_size
        losses, correct = [], []
        n = len(order)
        with tf.device(self._held()):
            # One gather per epoch, then slices, as a hand-written loop over in-memory data does.
            idx = tf.constant(order, tf.int64)
            x, y = tf.gather(self.x_train, idx), tf.gather(self.y_train, idx)
        with tf.device(self.device):
            for start in range(0, n, bs):
                with tf.device(self._held()):  # a slice where the arrays are
                    xb, yb = x[start:start + bs], y[start:start + bs]
                loss, hits = self._train_step(xb, yb)
                losses.append(loss)
                correct.append(hits)
            sizes = tf.constant(np.minimum(bs, n - np.arange(0, n, bs)), tf.float32)
            mean_loss = tf.reduce_sum(tf.stack(losses) * sizes) / n
            acc = tf.reduce_sum(tf.stack(correct)) / n
        self._losses = losses  # device scalars, stacked outside the clock (``step_losses``)
        return mean_loss, acc  # device values: the worker fetches them (the sync) before the clock

    def step_losses(self) -> Optional[tf.Tensor]:
        losses = getattr(self, "_losses", None)
        return None if losses is None else tf.cast(tf.stack(losses), tf.float32)

    def scores(self, x: tf.Tensor, batch_size: int) -> tf.Tensor:
        n = int(x.shape[0])
        if n == 0:
            return tf.zeros((0, *self.net.graph.output.out_shape), tf.float32)
        parts = []
        for s in range(0, n, batch_size):
            with tf.device(self._held()):  # a slice where the arrays are
                xb = x[s:s + batch_size]
            with tf.device(self.device):
                parts.append(self._predict_step(xb))
        with tf.device(self.device):
            return tf.concat(parts, 0)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        # A twin without dropout, with its own optimizer: the worker builds afresh afterwards.
        twin = self._no_dropout_twin()
        with tf.device(self.device):
            opt = keras3_optimizer(keras, self.workload, twin)
            opt.build(twin.model.trainable_variables)
        step, _ = self._compile_steps(twin.model, opt)
        losses = []
        with tf.device(self.device):
            for xb, yb in batches:
                loss, _ = step(tf.constant(xb, tf.float32), tf.constant(yb, tf.int64))
                losses.append(float(loss.numpy()))
        return losses

    def train_scores(self, x: tf.Tensor) -> tf.Tensor:
        twin = self._no_dropout_twin()  # its moving statistics may change; the model's do not
        with tf.device(self.device):
            return tf.cast(twin.model(x, training=True), tf.float32)

    def gemm_peak(self, precision: str) -> float:
        """Best FLOP/s of a square matmul in ``precision``, synced (n 2048 and 4096 on CPU, 8192 on
        GPU; a few seconds). Eager ops, not a tf.function: grappler would merge identical matmuls."""
        dtype = {"fp32": tf.float32, "tf32": tf.float32, "bf16": tf.bfloat16, "fp16": tf.float16}[precision]

        def make(n: int, reps: int) -> Any:
            with tf.device(self.device):
                a = tf.cast(tf.random.stateless_uniform((n, n), seed=(0, 1)), dtype)
                b = tf.cast(tf.random.stateless_uniform((n, n), seed=(0, 2)), dtype)

            def run() -> None:
                with tf.device(self.device):
                    for _ in range(reps):
                        c = tf.matmul(a, b)
                    c[:1, :1].numpy()  # waits for the queued matmuls (one stream, in order)
            return run

        return gemm_rate(make, cpu=not self.device.startswith("/GPU"))
