"""NumPy reference backend: forward and backward of the whole layer vocabulary, no framework.

Two uses:

- ground truth for the worker's checks: ``forward`` (float64 inference outputs for the parity
  check) and ``train_losses`` (float64 losses of the first training steps, for the trajectory check);
- a backend of its own, ``numpy`` (``NumpyBackend``): float32 training with NumPy on the CPU, or
  with CuPy on ``--device gpu`` when CuPy and a CUDA device are present.

Semantics follow Keras 3, since the shared initial weights and the workload YAML do: TF 'same'
padding (extra pixel after), 'valid' max pooling with stride = pool size by default, inverted
dropout, softmax + categorical cross-entropy computed from the logits, Keras optimizer formulas
and defaults (see ``_numpy_ops``). A network that does not end in softmax has its outputs taken
as logits by the loss (``from_logits=True``).
"""
from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import BackendUnavailable
from ..model import final_softmax
from ..workload import ActivationLayer, Conv2D, Dense, Dropout, Flatten, MaxPool2D, Workload
from . import _numpy_ops as ops
from .base import Backend, batches, gpu_index

Array = ops.Array


def _activation(layer: Any) -> str:
    return getattr(layer, "activation", getattr(layer, "function", "none"))


class Network:
    """The layers of a workload run as array functions over a flat weight list.

    ``weights`` is ``[kernel0, bias0, kernel1, bias1, ...]`` in the canonical layout; the list's
    arrays are used as they are (not copied), so an optimizer stepping on ``weights`` trains the
    network. The dtype and array module (NumPy or CuPy) are those of the weights and inputs.
    """

    def __init__(self, layers: Sequence[Any], weights: Sequence[Array]):
        self.layers = tuple(layers)
        self.weights = list(weights)
        expected = 2 * sum(isinstance(layer, (Conv2D, Dense)) for layer in self.layers)
        if len(self.weights) != expected:
            raise ValueError(f"the model has {expected} weight arrays; got {len(self.weights)}")
        #: The loss is computed from the logits behind a final softmax (see ``softmax_cross_entropy``).
        self.softmax_out = final_softmax(self.layers)

    def forward(self, x: Array) -> Array:
        """Inference-mode output (dropout off): probabilities if the network ends in softmax."""
        scores = self.logits(x)
        return ops.softmax(scores) if self.softmax_out else scores

    def logits(self, x: Array) -> Array:
        """Inference-mode scores before a final softmax (the output itself when there is none)."""
        return self._run(x, rng=None, keep=False)[0]

    def loss_and_grads(self, x: Array, y: Array, rng: Any = None) -> tuple[Array, list[Array], Array]:
        """(mean loss, gradients in weight order, scores) of one training batch.

        ``y`` is one-hot; ``rng`` drives dropout, and ``None`` turns dropout off. ``scores`` are the
        logits (pre-softmax) of the training forward pass, e.g. for the training accuracy.
        """
        scores, tape = self._run(x, rng=rng, keep=True)
        loss, _, probs = ops.softmax_cross_entropy(scores, y)
        # Fused softmax + cross-entropy gradient of the batch mean: d loss / d logits = (p - y) / N.
        return loss, self._backward((probs - y) / len(x), tape), scores

    def loss(self, x: Array, y: Array, rng: Any = None) -> Array:
        """Mean loss of a batch (``loss_and_grads`` without the backward pass)."""
        scores, _ = self._run(x, rng=rng, keep=False)
        return ops.softmax_cross_entropy(scores, y)[0]

    def _run(self, x: Array, rng: Any, keep: bool) -> tuple[Array, list[tuple]]:
        tape: list[tuple] = []
        k = 0
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            fn = _activation(layer)
            if i == last and fn == "softmax":
                fn = "none"  # the loss (or ``forward``) applies it
            cache: Any = None
            if isinstance(layer, Conv2D):
                x, cache = ops.conv2d(x, self.weights[k], self.weights[k + 1], layer.stride, layer.padding)
                k += 2
            elif isinstance(layer, Dense):
                x, cache = ops.dense(x, self.weights[k], self.weights[k + 1])
                k += 2
            elif isinstance(layer, MaxPool2D):
                x, cache = ops.maxpool2d(x, layer.pool_size, layer.stride or layer.pool_size)
            elif isinstance(layer, Dropout):
                if rng is not None and layer.rate > 0:
                    x, cache = ops.dropout(x, layer.rate, rng)
            elif isinstance(layer, Flatten):
                cache = x.shape
                x = x.reshape(len(x), -1)  # NHWC order, as the canonical dense kernel expects
            elif not isinstance(layer, ActivationLayer):
                raise TypeError(f"unknown layer {layer!r}")
            pre = x
            x = ops.activate(pre, fn)
            if keep:
                tape.append((cache, fn, pre, x))
        return x, tape

    def _backward(self, g: Array, tape: list[tuple]) -> list[Array]:
        grads: list[Array] = [None] * len(self.weights)
        k = len(self.weights)
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            cache, fn, pre, post = tape[i]
            g = ops.activate_backward(g, fn, pre, post)
            if isinstance(layer, Conv2D):
                k -= 2
                g, grads[k], grads[k + 1] = ops.conv2d_backward(g, cache, need_dx=i > 0)
            elif isinstance(layer, Dense):
                k -= 2
                g, grads[k], grads[k + 1] = ops.dense_backward(g, cache)
            elif isinstance(layer, MaxPool2D):
                g = ops.maxpool2d_backward(g, cache)
            elif isinstance(layer, Dropout) and cache is not None:
                g = g * cache
            elif isinstance(layer, Flatten):
                g = g.reshape(cache)
        return grads


# --- ground truth for the worker's checks ------------------------------------------------------
def forward(workload: Workload, weights: Sequence[np.ndarray], x: np.ndarray,
            dtype: Any = np.float64) -> np.ndarray:
    """Inference-mode output of the workload's network on ``x`` (NHWC), computed in ``dtype``.

    Returns float64 NumPy: probabilities when the network ends in softmax.
    """
    net = Network(workload.model, [np.asarray(w, dtype) for w in weights])
    return np.asarray(net.forward(np.asarray(x, dtype)), np.float64)


def train_losses(workload: Workload, weights: Sequence[np.ndarray],
                 batches: Sequence[tuple[np.ndarray, np.ndarray]], dtype: Any = np.float64,
                 optimizer: Optional[ops.Optimizer] = None) -> list[float]:
    """Loss of each of ``len(batches)`` training steps from ``weights``, dropout disabled.

    ``batches`` are ``(x, integer labels)``; each loss comes from the forward pass before that
    step's update (as frameworks report it). ``weights`` are not modified. ``optimizer`` replaces
    the workload's (benchmarks/trajectory_spread.py runs deliberately wrong rules through it).
    """
    return _train_steps(workload, [np.array(w, dtype) for w in weights],
                        optimizer or ops.make_optimizer(workload.training), batches, np, dtype)


def _train_steps(workload: Workload, weights: list[Array], optimizer: ops.Optimizer,
                 batch_list: Sequence[tuple[np.ndarray, np.ndarray]], xp: ModuleType, dtype: Any) -> list[float]:
    net = Network(workload.model, weights)
    losses = []
    for x, y in batch_list:
        labels = xp.asarray(np.asarray(y, np.int64))
        loss, grads, _ = net.loss_and_grads(xp.asarray(x, dtype), ops.one_hot(labels, workload.num_classes, dtype))
        optimizer.step(net.weights, grads)
        losses.append(float(loss))
    return losses


# --- the `numpy` backend -------------------------------------------------------------------------
def array_module(device: str) -> ModuleType:
    """``numpy`` for "cpu"; ``cupy``, on the GPU ``--device`` names, when CuPy and that device are present.

    Raises ``BackendUnavailable`` (one line) otherwise. CuPy is imported only here.
    """
    index = gpu_index(device, "numpy")
    if index is None:
        return np
    if importlib.util.find_spec("cupy") is None:
        raise BackendUnavailable("numpy on --device gpu needs CuPy, which was not found: "
                                 "pip install cupy-cuda12x (match your CUDA version)")
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a broken CUDA install surfaces here as many different errors
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise BackendUnavailable(f"CuPy is installed but cannot reach a GPU: {first}") from None
    if index >= count:
        raise BackendUnavailable(f"CuPy sees {count} CUDA device(s); there is no cuda:{index}")
    cupy.cuda.Device(index).use()  # CuPy allocates and launches on the current device
    return cupy


def _to_host(x: Array) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)  # cupy.ndarray.get() copies to the host


class NumpyBackend(Backend):
    """Float32 training on the reference implementation (NumPy on CPU, CuPy on GPU)."""

    name = "numpy"

    def __init__(self, workload: Workload, device: str, mode: str = "reference", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        self.xp = array_module(device)
        self.dtype = np.float64 if precision == "fp64" else np.float32
        self.net: Optional[Network] = None
        self.optimizer: Optional[ops.Optimizer] = None
        self.rng: Any = None
        self.train_data: tuple[Array, Array] = (None, None)

    @classmethod
    def probe(cls) -> dict:
        try:
            array_module("gpu")
            gpu = ["gpu"]
        except BackendUnavailable:
            gpu = []
        return {"version": np.__version__, "devices": ["cpu"] + gpu}

    def version(self) -> str:
        return np.__version__ if self.xp is np else f"{np.__version__} (cupy {self.xp.__version__})"

    def device_id(self) -> str:
        return "cpu" if self.xp is np else f"cuda:{self.xp.cuda.Device().id}"

    def gpu_name(self) -> str:
        if self.xp is np:
            return ""
        props = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def build(self, weights: Sequence[np.ndarray]) -> int:
        self.net = Network(self.workload.model, [self.xp.array(w, dtype=self.dtype) for w in weights])
        self.optimizer = ops.make_optimizer(self.workload.training)
        entropy = [self.workload.seed % 2**64, 0xD209]  # SeedSequence rejects negative seeds
        seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        self.rng = self.xp.random.default_rng(seed)  # dropout masks; reseeded on every build
        return int(sum(w.size for w in self.net.weights))

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        xp = self.xp
        self.train_data = (xp.asarray(x_train, dtype=self.dtype), xp.asarray(y_train, dtype=xp.int64))

    def to_device(self, x: np.ndarray) -> Array:
        return self.xp.asarray(x, dtype=self.dtype)

    def to_host(self, value: Any) -> Any:
        return _to_host(value)

    def sync(self) -> None:
        if self.xp is not np:
            self.xp.cuda.Stream.null.synchronize()  # CuPy kernels are asynchronous

    def _net(self) -> Network:
        if self.net is None:
            raise RuntimeError("build() must be called first")
        return self.net

    def train_epoch(self, order: np.ndarray) -> tuple[Array, Array]:
        net, xp = self._net(), self.xp
        x_all, y_all = self.train_data
        order = xp.asarray(order)
        loss_sum, correct = xp.zeros((), np.float64), xp.zeros((), np.int64)
        for idx in batches(order, self.workload.training.batch_size):
            x, labels = x_all[idx], y_all[idx]
            y = ops.one_hot(labels, self.workload.num_classes, self.dtype)
            loss, grads, scores = net.loss_and_grads(x, y, self.rng)
            self.optimizer.step(net.weights, grads)  # type: ignore[union-attr]
            loss_sum += loss * len(idx)
            correct += (scores.argmax(axis=1) == labels).sum()
        n = len(order)
        return loss_sum / n, correct / n

    def scores(self, x: Array, batch_size: int) -> Array:
        net, xp = self._net(), self.xp
        parts = [net.forward(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        return xp.concatenate(parts) if parts else xp.zeros((0, self.workload.num_classes), self.dtype)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        net = self._net()
        return _train_steps(self.workload, net.weights, self.optimizer, batches, self.xp, self.dtype)

    def get_weights(self) -> list[np.ndarray]:
        return [_to_host(w).copy() for w in self._net().weights]
