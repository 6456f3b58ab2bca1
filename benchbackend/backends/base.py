"""The Backend contract. Every adapter (``backends/<name>.py``) implements it for one framework.

The worker (``benchbackend.worker``) drives an adapter through one repeat of one workload:

1. ``__init__(workload, device)`` -- resolve the device or raise ``BackendUnavailable``.
2. ``build(weights)`` -- build the network from ``workload.model`` and load the shared initial
   weights (canonical layout, see ``benchbackend.model``), converting as the framework needs.
3. ``set_data(...)`` -- take the run's arrays (float32 NHWC images in [0, 1], int64 labels) and
   keep them where the framework's fast path wants them (tensors on the device).
4. ``forward(x)`` -- inference-mode outputs (dropout off) as float64 NumPy, for the parity check.
5. ``train_epoch(order)`` -- one epoch over the training arrays in exactly the given sample order,
   batch size from the workload, the workload's optimizer and loss. Returns host floats (mean loss,
   accuracy), which is the device sync: the clock is read after it returns.
6. ``evaluate(split)`` -- loss and accuracy on ``"val"`` or ``"test"`` in inference mode.
7. ``predict()`` -- class probabilities over the test set (one timed inference pass); must return
   host data (synced).
8. ``train_steps(batches)`` -- optional: losses of the first K steps on given batches with dropout
   disabled, for the opt-in trajectory check.

Adapters import their framework at module top: only the worker imports an adapter, after it has
set the backend's environment variables (see ``BackendSpec.env``).
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import numpy as np

from ..workload import Workload


class Backend:
    #: Registry name, e.g. "torch"; matches the module name.
    name: ClassVar[str] = ""
    #: Execution mode written to the CSV ``mode`` column (e.g. "eager", "tf.function").
    mode: str = ""

    def __init__(self, workload: Workload, device: str):
        self.workload = workload
        self.requested_device = device

    # --- identity -------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> dict:
        """``{"version": str, "devices": [str, ...]}`` as this framework sees them (for ``list``)."""
        raise NotImplementedError

    def version(self) -> str:
        """Framework version string for ``backend_version``."""
        raise NotImplementedError

    def device_id(self) -> str:
        """The device actually used, as written to the ``device`` column (e.g. "cpu", "cuda:0")."""
        raise NotImplementedError

    def gpu_name(self) -> str:
        """Human name of the GPU in use, or "" on CPU."""
        return ""

    # --- lifecycle ------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        """Build the model, load ``weights`` (canonical layout); return its parameter count."""
        raise NotImplementedError

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
                 x_test: np.ndarray, y_test: np.ndarray) -> None:
        raise NotImplementedError

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Inference-mode output (probabilities if the model ends in softmax) as float64."""
        raise NotImplementedError

    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        """Train one epoch over ``x_train[order]`` in batches; return (mean loss, accuracy)."""
        raise NotImplementedError

    def evaluate(self, split: str) -> tuple[float, float]:
        """(mean loss, accuracy) on ``split`` ("val" or "test"), inference mode."""
        raise NotImplementedError

    def predict(self) -> np.ndarray:
        """Class scores for the whole test set, as a host array (this call is what is timed)."""
        raise NotImplementedError

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        """Loss of each of the first K training steps on these batches, dropout disabled."""
        raise NotImplementedError(f"{self.name} does not support the trajectory check")

    def get_weights(self) -> list[np.ndarray]:
        """Current weights converted back to the canonical layout (tests use it)."""
        raise NotImplementedError


def batches(order: np.ndarray, batch_size: int):
    """Consecutive index slices of ``order``; the last batch may be short (as Keras fit does)."""
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(scores, axis=1) == labels)) if len(labels) else float("nan")
