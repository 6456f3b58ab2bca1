"""Keras 3 adapters on JAX and on PyTorch: the path a Keras user runs, ``compile`` + ``fit`` + ``predict``.

One class, parametrized by the framework under Keras (``KerasJaxBackend``, ``KerasTorchBackend``).
Keras reads ``KERAS_BACKEND`` once, when it is first imported; the registry's ``env`` sets it in
the worker's environment before this module is imported, and ``__init__`` refuses to run on
another framework than the one it is named for.

Training is ``model.fit`` on the epoch's samples gathered in the given order, with
``shuffle=False``, ``epochs=1`` and the workload's batch size: Keras slices consecutive batches
and keeps the last short one, so the batches and their order are exactly ``order``'s. ``fit``
rather than ``train_on_batch`` in a loop because ``fit`` is what Keras users run and it is
Keras' fast path (one compiled train function, no per-call metric reset and host return).
``jit_compile`` is left at Keras' default ("auto": XLA on JAX, eager on PyTorch). The optimizers
are Keras' own, so the update rules are Keras' by construction. Accuracy on validation and test
comes from ``scores`` (``model.predict``) and is computed by the harness, not by Keras.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import keras
import numpy as np

from ..errors import BackendUnavailable
from ..workload import Workload
from .base import Backend
from .keras_layers import KerasNet, keras3_build, keras3_optimizer


class KerasBackend(Backend):
    """Keras 3 on ``framework`` (the value of ``KERAS_BACKEND`` it needs)."""

    framework: ClassVar[str] = ""

    def __init__(self, workload: Workload, device: str, mode: str = "fit", precision: str = "fp32",
                 options: Optional[dict[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        running = keras.backend.backend()
        if running != self.framework:
            raise BackendUnavailable(f"{self.name}: Keras runs on '{running}' in this process; it needs "
                                     f"KERAS_BACKEND={self.framework} set before keras is imported")
        if mode != "fit":
            raise BackendUnavailable(f"{self.name}: unknown mode '{mode}'; use fit")
        if precision not in ("fp32", "tf32"):
            raise BackendUnavailable(f"{self.name}: precision '{precision}' is not supported; use fp32 or tf32")
        self.device = self._resolve_device(device)
        self.math = self._set_math(precision)  # the framework's flags: Keras has none of its own
        self.model: Optional[keras.Model] = None
        self.net: Optional[KerasNet] = None

    # --- per framework ------------------------------------------------------------------------
    def _resolve_device(self, device: str) -> str:
        raise NotImplementedError

    def _set_math(self, precision: str) -> str:
        """The precision rule (``backends/precision.py``) in the framework under Keras."""
        raise NotImplementedError

    # --- identity -----------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> dict:
        return {"version": f"keras {keras.__version__} ({keras.backend.backend()})", "devices": cls._devices()}

    @classmethod
    def _devices(cls) -> list[str]:
        return []

    def version(self) -> str:
        return f"{keras.__version__} ({self.framework} {self._framework_version()})"

    def _framework_version(self) -> str:
        return ""

    def device_id(self) -> str:
        return self.device

    # --- model --------------------------------------------------------------------------------
    def _compiled(self, dropout: bool, weights: Sequence[np.ndarray]) -> KerasNet:
        net = keras3_build(self.workload, keras, dropout=dropout)
        net.set(weights)  # Keras' own layouts are the canonical ones
        # Integer labels: sparse cross-entropy is categorical cross-entropy on one-hot targets.
        # fit and train_on_batch add the L2 kernel regularizers to the loss, as Keras does.
        net.model.compile(optimizer=keras3_optimizer(keras, self.workload, net),
                          loss=keras.losses.SparseCategoricalCrossentropy(),
                          metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
        return net

    def build(self, weights: Sequence[np.ndarray]) -> int:
        self.net = self._compiled(True, weights)
        self.model = self.net.model
        return int(sum(int(np.prod(v.shape)) for v in self.model.weights))

    def get_weights(self) -> list[np.ndarray]:
        assert self.net is not None
        return [np.asarray(w) for w in self.net.get()]

    # --- data and run -------------------------------------------------------------------------
    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self.x, self.y = np.ascontiguousarray(x_train, np.float32), np.asarray(y_train, np.int64)

    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        assert self.model is not None
        bs = self.workload.training.batch_size
        history = self.model.fit(self.x[order], self.y[order], batch_size=bs, epochs=1, shuffle=False, verbose=0)
        # Keras' epoch loss and accuracy are means over samples (each batch weighted by its size).
        return float(history.history["loss"][-1]), float(history.history["accuracy"][-1])

    def scores(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        assert self.model is not None
        if len(x) == 0:
            return np.zeros((0, self.workload.num_classes), np.float32)
        return self.model.predict(x, batch_size=batch_size, verbose=0)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        assert self.net is not None
        # A twin without dropout layers on the current weights (Dropout has none), with a fresh
        # optimizer: the worker calls this right after build, and builds again afterwards.
        twin = self._compiled(False, self.net.get())
        # train_on_batch resets the metrics first, so its loss is this batch's, before the update.
        return [float(twin.model.train_on_batch(np.asarray(xb, np.float32), np.asarray(yb, np.int64),
                                                return_dict=True)["loss"]) for xb, yb in batches]

    def train_scores(self, x: np.ndarray) -> np.ndarray:
        assert self.net is not None
        twin = keras3_build(self.workload, keras, dropout=False)  # its moving statistics may change
        twin.set(self.net.get())
        return keras.ops.convert_to_numpy(twin.model(np.asarray(x, np.float32), training=True))


class KerasJaxBackend(KerasBackend):
    name = "keras-jax"
    framework = "jax"

    def _resolve_device(self, device: str) -> str:
        import jax

        from .jax import jax_device

        dev = jax_device(device, self.name)
        # Keras on JAX puts variables and steps on JAX's default device.
        jax.config.update("jax_default_device", dev)
        self._dev = dev
        self._gpu = "" if dev.platform == "cpu" else str(dev.device_kind)
        return "cpu" if dev.platform == "cpu" else f"{dev.platform}:{dev.id}"

    def _set_math(self, precision: str) -> str:
        from .jax import set_math

        return set_math(self._dev, precision, self.name)

    @classmethod
    def _devices(cls) -> list[str]:
        import jax

        return [f"{d.platform}:{d.id}" for d in jax.devices()]

    def _framework_version(self) -> str:
        import jax

        return jax.__version__

    def gpu_name(self) -> str:
        return self._gpu


class KerasTorchBackend(KerasBackend):
    name = "keras-torch"
    framework = "torch"

    def _resolve_device(self, device: str) -> str:
        from .torch import cuda_device

        want = str(cuda_device(device, self.name))
        from keras.src.backend.torch.core import get_device

        # Keras picks its torch device when imported (KERAS_TORCH_DEVICE, else CUDA when present).
        actual = str(get_device())
        if actual != want and not (want == "cuda:0" and actual == "cuda"):
            raise BackendUnavailable(f"{self.name}: Keras placed itself on torch device '{actual}'; "
                                     f"set KERAS_TORCH_DEVICE={want} before keras is imported")
        return want

    def _set_math(self, precision: str) -> str:
        import torch

        from .torch import set_math

        return set_math(torch.device(self.device), precision, self.name)

    @classmethod
    def _devices(cls) -> list[str]:
        import torch

        return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]

    def _framework_version(self) -> str:
        import torch

        return torch.__version__

    def gpu_name(self) -> str:
        if self.device == "cpu":
            return ""
        import torch

        return torch.cuda.get_device_name(torch.device(self.device))

    def sync(self) -> None:
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(torch.device(self.device))
