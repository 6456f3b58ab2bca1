"""TensorFlow adapter: a Keras 3 model trained by a compiled ``tf.function`` step over in-memory tensors."""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

import keras

from ..errors import BackendUnavailable
from ..workload import Workload
from .base import Backend
from .keras_layers import keras_layers



class TensorFlowBackend(Backend):
    name = "tensorflow"

    def __init__(self, workload: Workload, device: str, mode: str = "tf.function", precision: str = "fp32",
                 options: Mapping[str, Any] | None = None):
        super().__init__(workload, device, mode, precision, options)
        threads = self.options.get("threads")
        if threads:  # must precede any TensorFlow op
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
            tf.config.threading.set_inter_op_parallelism_threads(int(threads))
        if device == "cpu":
            self.device = "/CPU:0"
        elif device in ("gpu", "cuda") or device.startswith("/GPU:"):
            gpus = tf.config.list_physical_devices("GPU")
            if not gpus:
                raise BackendUnavailable("tensorflow sees no GPU (tf.config.list_physical_devices('GPU') is empty); "
                                         "use --device cpu, or install `tensorflow[and-cuda]` on a CUDA machine")
            self.device = "/GPU:0" if device in ("gpu", "cuda") else device
        else:
            raise BackendUnavailable(f"tensorflow: unknown device '{device}'; use cpu or gpu")

    @classmethod
    def probe(cls) -> dict:
        devices = [d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()]
        return {"version": tf.__version__, "devices": devices}

    def version(self) -> str:
        return tf.__version__

    def device_id(self) -> str:
        return self.device.strip("/").lower()

    def gpu_name(self) -> str:
        if not self.device.startswith("/GPU"):
            return ""
        gpus = tf.config.list_physical_devices("GPU")
        return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu") if gpus else ""

    # --- model ------------------------------------------------------------------------------
    def _model(self, dropout: bool = True) -> keras.Model:
        inputs = [keras.Input(shape=self.workload.input_shape)]
        return keras.Sequential(inputs + keras_layers(self.workload, keras.layers, dropout))

    def _optimizer(self) -> keras.optimizers.Optimizer:
        t = self.workload.training
        if t.optimizer == "sgd":
            return keras.optimizers.SGD(learning_rate=t.lr, momentum=t.momentum)
        if t.optimizer == "adam":
            return keras.optimizers.Adam(learning_rate=t.lr)
        return keras.optimizers.RMSprop(learning_rate=t.lr)

    def build(self, weights: Sequence[np.ndarray]) -> int:
        with tf.device(self.device):
            self.model = self._model()
            self.model.set_weights(list(weights))  # Keras' own layout is the canonical one
            self.opt = self._optimizer()
            self.opt.build(self.model.trainable_variables)
            self.loss_fn = keras.losses.CategoricalCrossentropy()
        self._compile_steps()
        return int(sum(int(np.prod(v.shape)) for v in self.model.weights))

    def _compile_steps(self) -> None:
        nc = self.workload.num_classes
        model, opt, loss_fn = self.model, self.opt, self.loss_fn
        # No input_signature: each batch shape (full, and the last short one) gets its own trace
        # with static shapes, which TF's CPU kernels run measurably faster (5-9% on cifar10) than
        # a single trace with an unknown batch dimension.
        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                probs = model(x, training=True)
                loss = loss_fn(tf.one_hot(y, nc), probs)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            # Returned, not accumulated in variables: assign_add adds ordering constraints
            # that cost 3-5% of a cifar10 step on CPU.
            return loss, tf.reduce_sum(tf.cast(tf.argmax(probs, 1) == y, tf.int32))

        @tf.function
        def predict_step(x):
            return model(x, training=False)

        self._train_step, self._predict_step = train_step, predict_step

    def get_weights(self) -> list[np.ndarray]:
        return [np.asarray(w) for w in self.model.get_weights()]

    def threads(self) -> int:
        return tf.config.threading.get_intra_op_parallelism_threads() or (os.cpu_count() or 1)

    # --- data -------------------------------------------------------------------------------
    def to_device(self, x: np.ndarray) -> tf.Tensor:
        with tf.device(self.device):
            return tf.constant(x, tf.float32)

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        with tf.device(self.device):
            self.x_train = tf.constant(x_train, tf.float32)
            self.y_train = tf.constant(y_train, tf.int64)

    def to_host(self, value: Any) -> Any:
        return value.numpy() if hasattr(value, "numpy") else np.asarray(value)

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[tf.Tensor, tf.Tensor]:
        bs = self.workload.training.batch_size
        losses, correct = [], []
        n = len(order)
        with tf.device(self.device):
            # One gather per epoch, then slices, as a hand-written loop over in-memory data does.
            idx = tf.constant(order, tf.int64)
            x, y = tf.gather(self.x_train, idx), tf.gather(self.y_train, idx)
            for start in range(0, n, bs):
                loss, hits = self._train_step(x[start:start + bs], y[start:start + bs])
                losses.append(loss)
                correct.append(hits)
            sizes = tf.constant(np.minimum(bs, n - np.arange(0, n, bs)), tf.float32)
            mean_loss = tf.reduce_sum(tf.stack(losses) * sizes) / n
            acc = tf.cast(tf.reduce_sum(tf.stack(correct)), tf.float32) / n
        return mean_loss, acc  # device values: the worker fetches them (the sync) before the clock

    def scores(self, x: tf.Tensor, batch_size: int) -> tf.Tensor:
        n = int(x.shape[0])
        if n == 0:
            return tf.zeros((0, self.workload.num_classes), tf.float32)
        with tf.device(self.device):
            return tf.concat([self._predict_step(x[s:s + batch_size]) for s in range(0, n, batch_size)], 0)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        nc = self.workload.num_classes
        losses = []
        for xb, yb in batches:
            with tf.device(self.device), tf.GradientTape() as tape:
                probs = self.model(tf.constant(xb, tf.float32), training=False)  # dropout off
                loss = self.loss_fn(tf.one_hot(yb, nc), probs)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            losses.append(float(loss.numpy()))
        return losses
