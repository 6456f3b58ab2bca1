"""NumPy reference backend: forward and backward of the whole layer vocabulary, no framework. Two uses:

- ground truth for the worker's checks: ``forward`` (float64 inference outputs for the parity
  check) and ``train_losses`` (float64 losses of the first training steps, for the trajectory check);
- a backend of its own, ``numpy`` (``NumpyBackend``): float32 training with NumPy on the CPU, or
  with CuPy on ``--device gpu`` when CuPy and a CUDA device are present; generation: ``generation.py``.

This module *defines* the conventions every adapter converts to. They follow Keras 3, since the
shared initial weights and the workload YAML do: TF 'same' padding (extra pixel after, at any
stride), max-pool padding that never wins a max, 'valid' max pooling with stride = pool size by
default, inverted dropout; batchnorm with batch statistics in training steps (biased variance,
which also updates the moving variance: ``moving = momentum * moving + (1 - momentum) * batch``)
and the moving statistics in inference; softmax + categorical cross-entropy computed from the
logits, plus the L2 penalty ``rate * sum(kernel ** 2)`` when the workload asks for one; Keras
optimizer formulas and defaults, Nesterov's SGD and decoupled weight decay included (see
``_numpy_ops``). A network that does not end in softmax has its outputs taken as logits by the
loss (``from_logits=True``). The network is the resolved graph (``benchbackend.spec.graph``): a layer's
gradient is the sum over every layer that reads its output.

Over 400 lines: the ground truth and the backend share one network (``Network``), and the
conventions it defines read in one place.
"""
from __future__ import annotations

import importlib.util
import math
import os
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ...errors import BackendUnavailable
from ...spec.graph import INPUT, Graph, Node, resolve
from ...spec.layers import Multiply, activation_name
from ...spec.model import kernel_mask, trainable_mask
from ...spec.workload import (
    ActivationLayer,
    Add,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool2D,
    TrainingSpec,
    Workload,
)
from ..base import Backend, CupyMemory, batches, gpu_index
from . import ops
from . import transformer as tr
from .generation import Generates

Array = ops.Array


class Network:
    """A resolved graph run as array functions over a flat weight list.

    ``weights`` is the canonical flat list (``benchbackend.spec.model``); its arrays are used as they
    are (not copied), so an optimizer stepping on ``params()`` trains the network, and a training
    pass updates the batchnorm moving statistics in place. The dtype and array module (NumPy or
    CuPy) are those of the weights and inputs. ``l2``: the rate of an L2 penalty on the kernels,
    added to the loss (``training.weight_decay`` of kind ``l2``).
    """

    def __init__(self, graph: Graph, weights: Sequence[Array], l2: float = 0.0):
        self.graph = graph
        self.weights = list(weights)
        if len(self.weights) != graph.n_weights:
            raise ValueError(f"the model has {graph.n_weights} weight arrays; got {len(self.weights)}")
        self.kernels = kernel_mask(graph)
        self.trainable = trainable_mask(graph)
        self.l2 = l2
        #: The loss is computed from the logits behind a final softmax (see ``softmax_cross_entropy``).
        self.softmax_out = graph.ends_in_softmax()

    def params(self) -> list[Array]:
        """The trainable arrays (what an optimizer steps), in weight order."""
        return [w for w, t in zip(self.weights, self.trainable) if t]

    def kernel_arrays(self) -> list[Array]:
        return [w for w, k in zip(self.weights, self.kernels) if k]

    def forward(self, x: Array, training: bool = False) -> Array:
        """Output with dropout off: probabilities if the network ends in softmax. ``training``:
        batchnorm uses the batch's statistics (and leaves the moving ones as they are)."""
        scores = self.logits(x, training)
        return ops.softmax(scores) if self.softmax_out else scores

    def logits(self, x: Array, training: bool = False) -> Array:
        """Scores before a final softmax (the output itself when there is none), dropout off."""
        return self._run(x, rng=None, training=training, update=False, keep=False)[0]

    def loss_and_grads(self, x: Array, y: Array, rng: Any = None) -> tuple[Array, list[Array], Array]:
        """(mean loss, gradients of ``params()``, scores) of one training step's forward and backward.
        ``y`` is one-hot (per position, for token sequences); ``rng`` drives dropout, and ``None``
        turns it off. Batchnorm uses the batch statistics and updates its moving ones. The loss
        includes the L2 penalty. ``scores`` are the logits (pre-softmax), for the training accuracy.
        """
        scores, tape = self._run(x, rng=rng, training=True, update=True, keep=True)
        loss, _, probs = ops.softmax_cross_entropy(scores, y)
        # Fused softmax + cross-entropy gradient of the mean over every prediction (per sample or per token).
        grads = self._backward((probs - y) / (y.size // y.shape[-1]), tape)
        if self.l2:
            loss = loss + ops.l2_penalty(self.kernel_arrays(), self.l2)
            grads = [g + 2 * self.l2 * w if k else g for g, w, k in zip(grads, self.weights, self.kernels)]
        return loss, [g for g, t in zip(grads, self.trainable) if t], scores

    def loss(self, x: Array, y: Array, rng: Any = None) -> Array:
        """Mean training-mode loss of a batch (``loss_and_grads`` without the backward pass or an update)."""
        scores, _ = self._run(x, rng=rng, training=True, update=False, keep=False)
        loss = ops.softmax_cross_entropy(scores, y)[0]
        return loss + ops.l2_penalty(self.kernel_arrays(), self.l2) if self.l2 else loss

    def _run(self, x: Array, rng: Any, training: bool, update: bool, keep: bool) -> tuple[Array, list[tuple]]:
        g, values = self.graph, []
        tape: list[tuple] = []
        for node in g.nodes:
            ins = [x if j == INPUT else values[j] for j in node.inputs]
            w = g.weights_of(node, self.weights)
            if node.tied is not None:  # the embedding's table, transposed, is this dense layer's kernel
                w = [g.weights_of(g.nodes[node.tied], self.weights)[0].T] + w
            out, cache = self._layer(node, ins, w, rng, training, update)
            fn = activation_name(node.layer, node.activation)
            if node is g.output and fn == "softmax":
                fn = "none"  # the loss (or ``forward``) applies it
            pre, post = out, tr.activate(out, fn)
            values.append(post)
            if keep:
                tape.append((cache, fn, pre, post))
        return values[-1], tape

    @staticmethod
    def _layer(node: Node, ins: list[Array], w: list[Array], rng: Any, training: bool, update: bool
               ) -> tuple[Array, Any]:
        layer, x = node.layer, ins[0]
        if isinstance(layer, Conv2D):
            return ops.conv2d(x, w[0], w[1] if layer.use_bias else None, layer.stride, node.pads)
        if isinstance(layer, Dense):
            return ops.dense(x, w[0], w[1] if layer.use_bias else 0)
        if isinstance(layer, MaxPool2D):
            return ops.maxpool2d(x, layer.pool_size, layer.stride or layer.pool_size, node.pads)
        if isinstance(layer, BatchNorm):
            if not training:
                return ops.batchnorm_infer(x, *w, layer.epsilon), None
            out, cache, mean, var = ops.batchnorm_train(x, w[0], w[1], layer.epsilon)
            if update:
                ops.moving_update(w[2], mean, layer.momentum)
                ops.moving_update(w[3], var, layer.momentum)
            return out, cache
        if isinstance(layer, Add):
            return sum(ins[1:], ins[0]), None
        if isinstance(layer, Multiply):
            return math.prod(ins[1:], start=ins[0]), ins
        if isinstance(layer, GlobalAvgPool):
            return ops.global_avgpool(x), x.shape
        if isinstance(layer, Dropout):
            if rng is not None and layer.rate > 0:
                return ops.dropout(x, layer.rate, rng)
            return x, None
        if isinstance(layer, Flatten):
            return x.reshape(len(x), -1), x.shape  # NHWC order, as the canonical dense kernel expects
        if isinstance(layer, ActivationLayer):
            return x, None
        return tr.forward(layer, x, w)  # the transformer layers

    def _backward(self, g_out: Array, tape: list[tuple]) -> list[Array]:
        """Gradients of every weight array (None for the moving statistics), in weight order."""
        graph = self.graph
        grads: list[Array] = [None] * len(self.weights)
        pending: list[Array] = [None] * len(graph.nodes)  # d loss / d output of each node, summed over readers
        pending[-1] = g_out
        for node in reversed(graph.nodes):
            cache, fn, pre, post = tape[node.index]
            g, pending[node.index] = pending[node.index], None
            g = tr.activate_backward(g, fn, pre, post)
            ins, ws = self._layer_backward(node, g, cache)
            if node.tied is not None:  # the kernel's gradient goes to the embedding's table, transposed
                table, kernel, ws = graph.offsets[node.tied], ws[0].T, ws[1:]
                grads[table] = kernel if grads[table] is None else grads[table] + kernel
            start = graph.offsets[node.index]
            for j, dw in enumerate(ws):  # a tied table has its dense layer's share already
                grads[start + j] = dw if grads[start + j] is None or dw is None else grads[start + j] + dw
            for j, dx in zip(node.inputs, ins):
                if j != INPUT and dx is not None:
                    pending[j] = dx if pending[j] is None else pending[j] + dx
        return grads

    @staticmethod
    def _layer_backward(node: Node, g: Array, cache: Any) -> tuple[list[Array], list[Array]]:
        """(gradients of the inputs, gradients of the node's weights)."""
        layer = node.layer
        if isinstance(layer, Conv2D):
            dx, dw, db = ops.conv2d_backward(g, cache, need_dx=node.inputs != (INPUT,))
            return [dx], [dw] + ([db] if layer.use_bias else [])
        if isinstance(layer, Dense):
            dx, dw, db = ops.dense_backward(g, cache)
            return [dx], [dw, db] if layer.use_bias else [dw]
        if isinstance(layer, MaxPool2D):
            return [ops.maxpool2d_backward(g, cache)], []
        if isinstance(layer, BatchNorm):
            dx, dgamma, dbeta = ops.batchnorm_train_backward(g, cache)
            return [dx], [dgamma, dbeta, None, None]
        if isinstance(layer, Add):
            return [g] * len(node.inputs), []
        if isinstance(layer, Multiply):  # each input's gradient: g times the others
            return [g * math.prod(cache[:i] + cache[i + 1:]) for i in range(len(cache))], []
        if isinstance(layer, GlobalAvgPool):
            return [ops.global_avgpool_backward(g, cache)], []
        if isinstance(layer, Dropout):
            return [g if cache is None else g * cache], []
        if isinstance(layer, Flatten):
            return [g.reshape(cache)], []
        return tr.backward(layer, g, cache)  # the transformer layers, and activation layers


def network(workload: Workload, weights: Sequence[Array]) -> Network:
    """The workload's network on ``weights``, with its L2 penalty."""
    decay = workload.training.weight_decay
    return Network(resolve(workload), weights, l2=decay.rate if decay and decay.kind == "l2" else 0.0)


def train_step(net: Network, optimizer: ops.Optimizer, x: Array, y: Array, training: TrainingSpec,
               rng: Any = None) -> tuple[Array, Array]:
    """One training step (the loss, the logits): forward and backward, then :func:`update`."""
    loss, grads, scores = net.loss_and_grads(x, y, rng)
    update(net, optimizer, grads, training)
    return loss, scores


def update(net: Network, optimizer: ops.Optimizer, grads: Sequence[Array], training: TrainingSpec) -> None:
    """Decoupled weight decay if the workload asks for it, then the optimizer's update of ``net.params()``."""
    decay = training.weight_decay
    if decay is not None and decay.kind == "decoupled":
        ops.decay_decoupled(net.kernel_arrays(), training.lr, decay.rate)
    optimizer.step(net.params(), grads)


# --- ground truth for the worker's checks ------------------------------------------------------
def forward(workload: Workload, weights: Sequence[np.ndarray], x: np.ndarray,
            dtype: Any = np.float64, training: bool = False) -> np.ndarray:
    """Output of the workload's network on ``x`` (NHWC), computed in ``dtype``, dropout off:
    inference mode (batchnorm's moving statistics), or with ``training`` the batch statistics.

    Returns float64 NumPy: probabilities when the network ends in softmax.
    """
    net = network(workload, [np.array(w, dtype) for w in weights])
    return np.asarray(net.forward(np.asarray(x, dtype), training=training), np.float64)


def train_losses(workload: Workload, weights: Sequence[np.ndarray],
                 batches: Sequence[tuple[np.ndarray, np.ndarray]], dtype: Any = np.float64,
                 optimizer: Optional[ops.Optimizer] = None) -> list[float]:
    """Loss of each of ``len(batches)`` training steps from ``weights``, dropout disabled.

    ``batches`` are ``(x, integer labels)``; each loss comes from the forward pass before that
    step's update (as frameworks report it). ``weights`` are not modified. ``optimizer`` replaces
    the workload's (benchmarks/trajectory_spread.py runs deliberately wrong rules through it).
    """
    return _train_steps(workload, network(workload, [np.array(w, dtype) for w in weights]),
                        optimizer or ops.make_optimizer(workload.training), batches, np, dtype)


def _train_steps(workload: Workload, net: Network, optimizer: ops.Optimizer,
                 batch_list: Sequence[tuple[np.ndarray, np.ndarray]], xp: ModuleType, dtype: Any) -> list[float]:
    losses = []
    for x, y in batch_list:
        labels = xp.asarray(np.asarray(y, np.int64))
        y1 = ops.one_hot(labels, workload.num_classes, dtype)
        loss, _ = train_step(net, optimizer, xp.asarray(x, dtype), y1, workload.training)
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


def _to_host(x: Array) -> np.ndarray:  # cupy.ndarray.get() copies to the host
    return x.get() if hasattr(x, "get") else np.asarray(x)


class NumpyBackend(Generates, CupyMemory, Backend):
    """Float32 training on the reference implementation (NumPy on CPU, CuPy on GPU)."""

    name = "numpy"

    def __init__(self, workload: Workload, device: str, mode: str = "reference", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        self.xp = array_module(device)
        self.dtype = np.float64 if precision == "fp64" else np.float32
        # NumPy is IEEE; CuPy runs float32 matmuls in TF32 only when CUPY_TF32=1 is set.
        self.math = "tf32" if self.xp is not np and os.environ.get("CUPY_TF32") == "1" else "ieee"
        self.net: Optional[Network] = None
        self.optimizer: Optional[ops.Optimizer] = None
        self.rng: Any = None
        self.train_data: tuple[Array, Array] = (None, None)
        self.cupy = None if self.xp is np else self.xp  # CupyMemory's counters

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
        self.net = network(self.workload, [self.xp.array(w, dtype=self.dtype) for w in weights])
        self.optimizer = ops.make_optimizer(self.workload.training)
        entropy = [self.workload.seed % 2**64, 0xD209]  # SeedSequence rejects negative seeds
        seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        self.rng = self.xp.random.default_rng(seed)  # dropout masks; reseeded on every build
        return int(sum(w.size for w in self.net.weights))

    # ``data_on_device``: the arrays are CuPy arrays (NumPy on a CPU) and epochs index them there;
    # else NumPy arrays, each batch copied to the GPU (``xp.asarray``) inside the clock.
    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        held = self.xp if self.data_on_device else np
        self.train_data = (held.asarray(x_train, dtype=self.dtype), held.asarray(y_train, dtype=np.int64))

    def to_device(self, x: np.ndarray) -> Array:
        return (self.xp if self.data_on_device else np).asarray(x, dtype=self.dtype)

    def to_host(self, value: Any) -> Any:
        return _to_host(value)

    def sync(self) -> None:
        if self.xp is not np:  # NumPy has finished when it returns
            self.xp.cuda.Stream.null.synchronize()  # CuPy kernels are asynchronous

    def _net(self) -> Network:
        if self.net is None:
            raise RuntimeError("build() must be called first")
        return self.net

    def train_epoch(self, order: np.ndarray) -> tuple[Array, Array]:
        net, xp = self._net(), self.xp
        x_all, y_all = self.train_data
        order = (xp if self.data_on_device else np).asarray(order)
        loss_sum, correct = xp.zeros((), np.float64), xp.zeros((), np.int64)
        self._losses: list[Array] = []  # each step's, for the loss audit (``step_losses``)
        for idx in batches(order, self.workload.training.batch_size):
            x, labels = xp.asarray(x_all[idx]), xp.asarray(y_all[idx])  # a copy only when held on the host
            y = ops.one_hot(labels, self.workload.num_classes, self.dtype)
            loss, scores = train_step(net, self.optimizer, x, y, self.workload.training, self.rng)
            loss_sum += loss * len(idx)
            self._losses.append(loss)
            correct += (scores.argmax(axis=-1) == labels).sum()  # every position's, for a language model
        n = len(order)
        return loss_sum / n, correct / (n * (y_all[0].size if len(y_all) else 1))

    def step_losses(self) -> Any:
        losses = getattr(self, "_losses", None)
        return None if losses is None else self.xp.stack([self.xp.asarray(v) for v in losses])

    def scores(self, x: Array, batch_size: int) -> Array:
        net, xp = self._net(), self.xp
        parts = [net.forward(xp.asarray(x[i:i + batch_size])) for i in range(0, len(x), batch_size)]
        return xp.concatenate(parts) if parts else xp.zeros((0, self.workload.num_classes), self.dtype)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        net = self._net()
        return _train_steps(self.workload, net, self.optimizer, batches, self.xp, self.dtype)

    def train_scores(self, x: Array) -> Array:
        return self._net().forward(self.xp.asarray(x), training=True)

    def get_weights(self) -> list[np.ndarray]:
        return [_to_host(w).copy() for w in self._net().weights]

