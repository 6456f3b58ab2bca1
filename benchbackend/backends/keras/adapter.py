"""Keras 3 adapters on JAX and on PyTorch: the path a Keras user runs, ``compile`` + ``fit`` + ``predict``.

One class, parametrized by the framework under Keras (``KerasJaxBackend``, ``KerasTorchBackend``).
Keras reads ``KERAS_BACKEND`` once, when it is first imported; the registry's ``env`` sets it in
the worker's environment before this module is imported, and ``__init__`` refuses to run on
another framework than the one it is named for.

Training is ``model.fit`` on the epoch's samples gathered in the given order, with
``shuffle=False``, ``epochs=1`` and the workload's batch size: consecutive batches, the last short
one kept, so the batches and their order are exactly ``order``'s. ``fit``
rather than ``train_on_batch`` in a loop because ``fit`` is what Keras users run and it is
Keras' fast path (one compiled train function, no per-call metric reset and host return).
``jit_compile`` is left at Keras' default ("auto": XLA on JAX, eager on PyTorch). The optimizers
are Keras' own, so the update rules are Keras' by construction. Accuracy on validation and test
comes from ``scores`` (``model.predict``) and is computed by the harness, not by Keras.

Data placement (``Backend.place_data``): the arrays are framework tensors on the device
(``keras.ops.convert_to_tensor``: a jax.Array on JAX's default device, which ``_resolve_device``
sets; a torch tensor on Keras' torch device), an epoch gathers them on the device
(``keras.ops.take``), and ``fit``/``predict`` read them through a ``keras.utils.PyDataset`` of
consecutive slices (``_Batches``). Not as arrays: Keras 3's array adapter turns a jax.Array into a
NumPy array before slicing (``array_slicing.convert_to_sliceable``), a copy back to the host on a
GPU, while a PyDataset's batches reach the compiled JAX step as they are (``get_jax_iterator``
passes jax.Arrays through; ``device_put`` to their own device is a no-op) and reach the torch step
through ``convert_to_tensor``, a no-op for a tensor on Keras' device. Where the arrays do not fit,
the same PyDataset slices NumPy arrays and Keras copies each batch inside the clock.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import keras
import numpy as np

from ...errors import BackendUnavailable
from ...spec.workload import Workload
from ..base import Backend
from ..jax.cache import KeepsCompiled
from .generation import KerasGeneration
from .layers import KerasNet, keras3_build, keras3_optimizer


class _Batches(keras.utils.PyDataset):
    """Consecutive slices of ``batch_size`` of ``arrays`` (the last one short), made in order in the
    calling thread (one worker, no multiprocessing), as tensors of wherever the arrays are."""

    def __init__(self, arrays: tuple[Any, ...], batch_size: int):
        super().__init__()
        self.arrays, self.batch_size = arrays, batch_size

    def __len__(self) -> int:
        return -(-len(self.arrays[0]) // self.batch_size)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        start = i * self.batch_size
        return tuple(a[start:start + self.batch_size] for a in self.arrays)


class KerasBackend(KerasGeneration, Backend):
    """Keras 3 on ``framework`` (the value of ``KERAS_BACKEND`` it needs). Generation: the cached
    forward of ``generation.py`` (``jax.jit`` on JAX, eager on PyTorch)."""

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
        self._placed: list[Any] = []  # tensors being copied to the device, for sync()

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
    def _put(self, a: np.ndarray) -> Any:
        """``a`` as a framework tensor on the device, or as it is when the data is not on the device."""
        if not self.data_on_device:
            return a
        out = keras.ops.convert_to_tensor(a)
        self._placed.append(out)
        return out

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        # int32 labels: JAX without x64 has no int64 (Keras' torch loss takes them as long itself).
        self.x, self.y = self._put(np.ascontiguousarray(x_train, np.float32)), self._put(np.asarray(y_train, np.int32))

    def to_device(self, x: np.ndarray) -> Any:
        return self._put(np.ascontiguousarray(x, np.float32))

    def take(self, x: Any, indices: np.ndarray) -> Any:
        return keras.ops.take(x, indices, axis=0)

    def to_host(self, value: Any) -> Any:
        return keras.ops.convert_to_numpy(value)  # a torch tensor on a GPU too (np.asarray would refuse it)

    def epoch_arrays(self, order: np.ndarray) -> tuple[Any, Any]:
        """The training arrays in the epoch's ``order``: one gather on the device where they live there."""
        if self.data_on_device:
            idx = keras.ops.convert_to_tensor(np.asarray(order, np.int32))
            return keras.ops.take(self.x, idx, axis=0), keras.ops.take(self.y, idx, axis=0)
        return self.x[order], self.y[order]

    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        assert self.model is not None
        x, y = self.epoch_arrays(order)
        history = self.model.fit(_Batches((x, y), self.workload.training.batch_size), epochs=1, shuffle=False,
                                 verbose=0)
        # Keras' epoch loss and accuracy are means over samples (each batch weighted by its size).
        return float(history.history["loss"][-1]), float(history.history["accuracy"][-1])

    def scores(self, x: Any, batch_size: int) -> np.ndarray:
        assert self.model is not None
        if len(x) == 0:
            return np.zeros((0, *self.net.graph.output.out_shape), np.float32)
        return self.model.predict(_Batches((x,), batch_size), verbose=0)

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
        return keras.ops.convert_to_numpy(twin.model(x, training=True))


class KerasJaxBackend(KeepsCompiled, KerasBackend):
    name = "keras-jax"
    framework = "jax"

    def _resolve_device(self, device: str) -> str:
        import jax

        from ..jax.adapter import jax_device

        dev = jax_device(device, self.name)
        # Keras on JAX puts variables and steps on JAX's default device.
        jax.config.update("jax_default_device", dev)
        self._dev = dev
        self._gpu = "" if dev.platform == "cpu" else str(dev.device_kind)
        return "cpu" if dev.platform == "cpu" else f"{dev.platform}:{dev.id}"

    def _set_math(self, precision: str) -> str:
        from ..jax.adapter import set_math

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

    def sync(self) -> None:
        """Wait for the model's variables (fit's last update) and the arrays being placed."""
        import jax

        values = [v.value for v in self.model.variables] if self.model is not None else []
        jax.block_until_ready(values + self._placed)
        self._placed = []

    def free_device_bytes(self) -> Optional[int]:
        from ..jax.adapter import memory

        return memory(self._dev)[0]

    def peak_device_mb(self) -> Optional[float]:
        from ..jax.adapter import memory

        return memory(self._dev)[1]


class KerasTorchBackend(KerasBackend):
    name = "keras-torch"
    framework = "torch"

    def _resolve_device(self, device: str) -> str:
        from ..torch.adapter import cuda_device

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

        from ..torch.adapter import set_math

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
        import torch

        from ..torch.adapter import synchronize

        synchronize(torch.device(self.device))
        self._placed = []

    def free_device_bytes(self) -> Optional[int]:
        import torch

        from ..torch.adapter import cuda_memory

        return cuda_memory(torch.device(self.device))[0]

    def peak_device_mb(self) -> Optional[float]:
        import torch

        from ..torch.adapter import cuda_memory

        return cuda_memory(torch.device(self.device))[1]

    def reset_device_peak(self) -> None:
        import torch

        from ..torch.adapter import reset_cuda_peak

        reset_cuda_peak(torch.device(self.device))
