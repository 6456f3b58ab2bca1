"""Chainer adapter: define-by-run, or the same chain with its forward method under ``static_graph``.

Runs in its own environment (``benchbackend setup chainer``: Chainer 7.8.1 needs NumPy < 2).

Modes:

- ``define-by-run``: a ``chainer.Chain`` whose forward pass builds the graph on every call.
- ``static-graph``: the chain's forward *method* wrapped by ``chainer.static_graph`` (as
  Chainer's own example does; not ``__call__``). The first call of each input shape traces a
  schedule, later calls replay it. The loss stays define-by-run, outside the static chain.
- ``ideep``: define-by-run with Intel's iDeep (MKL-DNN) kernels, when ``ideep4py`` is installed.

A language model (``workload.next_token``) takes token ids (N, T) as they come (float32 whole
numbers; the embedding casts them) and outputs (N, T, vocab): the loss is the mean cross-entropy
over every position, the accuracy the share of positions whose top score is the label.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional, Sequence

import chainer
import chainer.functions as F
import numpy as np
from chainer.backends import cuda, intel64

from ...errors import BackendUnavailable
from ...spec.graph import resolve
from ...spec.model import final_softmax, from_nchw_weights, to_nchw_weights
from ...spec.workload import Workload
from ..base import Backend, CupyMemory, gpu_index
from .graph import GraphChain, KerasNesterov


class _Net(GraphChain):
    """The graph chain; ``forward`` runs its body define-by-run, or under ``static_graph``."""

    def __init__(self, workload: Workload, static: bool):
        super().__init__(resolve(workload))
        self.static = static

    @chainer.static_graph
    def static_body(self, x: Any, *masks: Any) -> Any:
        return self.body(x, *masks)

    def forward(self, x: Any, *masks: Any) -> Any:
        return self.static_body(x, *masks) if self.static else self.body(x, *masks)


class ChainerBackend(CupyMemory, Backend):
    name = "chainer"
    #: --generate: not built; its decoder (``decoder.py``) runs whole sequences, for training and inference.
    generation_note = "no key/value cache path: its decoder runs whole sequences (training, inference) only"

    def __init__(self, workload: Workload, device: str, mode: str, precision: str = "fp32",
                 options: Optional[dict[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        if mode not in ("define-by-run", "static-graph", "ideep"):
            raise BackendUnavailable(f"chainer: unknown mode '{mode}'; use define-by-run, static-graph or ideep")
        if precision != "fp32":
            raise BackendUnavailable(f"chainer: precision {precision} is not supported; use fp32")
        index = gpu_index(device, self.name)
        self.xp, self.gpu = np, index is not None
        if self.gpu:
            if not cuda.available:
                raise BackendUnavailable("chainer sees no CUDA GPU: CuPy is not importable in the chainer "
                                         "environment (Chainer 7.8.1 needs cupy>=7.7,<8, which has no wheels for "
                                         "this Python); use --device cpu")
            self.xp = cuda.cupy
            self.device = chainer.get_device(f"@cupy:{index}")
        if mode == "ideep":
            if self.gpu:
                raise BackendUnavailable("chainer:ideep is a CPU mode (Intel MKL-DNN); use --device cpu")
            if not intel64.is_ideep_available():
                raise BackendUnavailable("chainer:ideep needs ideep4py, which has wheels for CPython 2.7-3.7 only "
                                         f"and no source release; this environment runs Python "
                                         f"{sys.version.split()[0]}")
        if not self.gpu:
            self.device = chainer.get_device("@intel64" if mode == "ideep" else "@numpy")
        self.net: Optional[_Net] = None
        self.cupy = cuda.cupy if self.gpu else None  # CupyMemory's counters

    @classmethod
    def probe(cls) -> dict:
        devices = ["cpu"]
        if intel64.is_ideep_available():
            devices.append("cpu (iDeep)")
        if cuda.available:
            devices += [f"cuda:{i}" for i in range(cuda.cupy.cuda.runtime.getDeviceCount())]
        return {"version": chainer.__version__, "devices": devices}

    def version(self) -> str:
        return chainer.__version__

    def device_id(self) -> str:
        return f"cuda:{self.device.device.id}" if self.gpu else "cpu"

    def gpu_name(self) -> str:
        if not self.gpu:
            return ""
        props = cuda.cupy.cuda.runtime.getDeviceProperties(self.device.device.id)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def details(self) -> dict[str, Any]:
        return {"numpy": np.__version__, "ideep": "yes" if self.mode == "ideep" else "no"}

    @contextlib.contextmanager
    def _config(self, train: bool) -> Iterator[None]:
        """Chainer's global config for a pass; static_graph's chatter goes to stderr.

        ``static_graph`` prints "end of build_schedule()" to stdout each time it traces a
        schedule. The worker's stdout is stderr already; this also covers in-process runs.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(chainer.using_config("train", train))
            stack.enter_context(chainer.using_config("enable_backprop", train))
            if self.mode == "ideep":
                stack.enter_context(chainer.using_config("use_ideep", "auto"))
            if self.mode == "static-graph":
                stack.enter_context(contextlib.redirect_stdout(sys.stderr))
            yield

    # --- model ------------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        if self.mode == "static-graph" and any(layer.type == "batchnorm" for layer in self.workload.model):
            raise BackendUnavailable("chainer:static-graph: batchnorm's moving statistics are updated outside "
                                     "Chainer functions, which a replayed static schedule skips; use define-by-run")
        self.net = _Net(self.workload, static=self.mode == "static-graph")
        self._load(weights)
        self.net.to_device(self.device)
        t = self.workload.training
        # Keras' update rules: Chainer's Adam adds eps to sqrt(v) before folding the bias
        # correction into the step (as Keras does), and RMSprop can put eps inside the sqrt.
        if t.optimizer == "sgd" and t.nesterov:
            opt = KerasNesterov(t.lr, t.momentum)
        elif t.optimizer == "sgd":
            opt = chainer.optimizers.MomentumSGD(t.lr, t.momentum) if t.momentum else chainer.optimizers.SGD(t.lr)
        elif t.optimizer == "adam":
            opt = chainer.optimizers.Adam(alpha=t.lr, beta1=0.9, beta2=0.999, eps=1e-7)
        else:
            opt = chainer.optimizers.RMSprop(lr=t.lr, alpha=0.9, eps=1e-7, eps_inside_sqrt=True)
        opt.setup(self.net)
        self.opt = opt
        self.softmax_out = final_softmax(self.workload.model)
        decay = t.weight_decay
        self.l2 = decay.rate if decay is not None and decay.kind == "l2" else 0.0
        self.decoupled = decay.rate * t.lr if decay is not None and decay.kind == "decoupled" else 0.0
        return sum(int(a.size) for a in self.net.arrays())

    def _load(self, weights: Sequence[np.ndarray]) -> None:
        assert self.net is not None
        targets = self.net.arrays()
        converted = to_nchw_weights(self.workload, weights)
        if len(targets) != len(converted):
            raise ValueError(f"the chain has {len(targets)} weight arrays; got {len(converted)}")
        for target, w, transposed in zip(targets, converted, self.net.transposed()):
            target[...] = w.T if transposed else w

    def get_weights(self) -> list[np.ndarray]:
        assert self.net is not None
        return from_nchw_weights(self.workload, [cuda.to_cpu(a.T if transposed else a)
                                                 for a, transposed in zip(self.net.arrays(), self.net.transposed())])

    # --- data -------------------------------------------------------------------------------
    # ``data_on_device``: the arrays are sent to the device (CuPy arrays on a GPU) and epochs gather
    # and slice them there; else they stay NumPy arrays and each batch is sent inside the clock.
    def _held(self, a: np.ndarray) -> Any:
        return self.device.send(a) if self.data_on_device else a

    def _feed(self, a: Any) -> Any:
        """A batch for the network: as it is when held on the device, else sent there now."""
        return a if self.data_on_device else self.device.send(a)

    def to_device(self, x: np.ndarray) -> Any:
        x = np.asarray(x, np.float32)
        if x.ndim != 4:  # token ids (N, T) or features: as they are
            return self._held(np.ascontiguousarray(x))
        return self._held(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))

    def take(self, x: Any, indices: np.ndarray) -> Any:
        return x[indices]

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self.x_train = self.to_device(x_train)
        self.y_train = self._held(np.asarray(y_train, np.int32))

    # --- run --------------------------------------------------------------------------------
    def _masks(self, n: int, unit: bool) -> list[Any]:
        """Static-graph dropout masks for a batch of ``n`` (all ones when ``unit``); none otherwise."""
        assert self.net is not None
        if not self.net.static and not unit:
            return []
        xp, out = self.xp, []
        for rate, shape in self.net.dropouts:
            if unit:
                mask = xp.ones((n, *shape), np.float32)
            else:
                mask = (xp.random.rand(n, *shape) >= rate).astype(np.float32) * np.float32(1.0 / (1.0 - rate))
            out.append(chainer.Variable(mask, requires_grad=False))
        return out

    def _step(self, x: Any, y: Any, unit_masks: bool = False) -> tuple[Any, Any]:
        assert self.net is not None
        # static_graph runs its schedule as one FunctionNode whose inputs are the chain's inputs:
        # if none of them requires a gradient, its backward (the parameters' gradients) never runs.
        # So the input is passed as an array there (wrapped as requiring a gradient), and as a
        # constant in define-by-run, where nothing needs d(loss)/dx.
        xv = x if self.net.static else chainer.Variable(x, requires_grad=False)
        logits = self.net.forward(xv, *self._masks(len(x), unit_masks))
        # Per sample, or per position of a token sequence: (N, T, V) scores as N*T rows, the mean over all.
        loss = F.softmax_cross_entropy(F.reshape(logits, (-1, logits.shape[-1])), y.reshape(-1))
        if self.l2:  # Keras' L2 kernel regularizer, in the loss
            loss = loss + self.l2 * sum(F.sum(k * k) for k in self.net.kernels())
        self.net.cleargrads()
        loss.backward()
        if self.decoupled:  # Keras 3's weight_decay, before the update
            for k in self.net.kernels():
                k.array *= 1.0 - self.decoupled
        self.opt.update()
        return loss.array, logits.array

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        idx = self._held(np.asarray(order))
        # One gather per epoch, then views: cheaper per step than indexing every batch.
        x, y = self.x_train[idx], self.y_train[idx]
        bs = self.workload.training.batch_size
        losses, correct = [], []
        self._losses: list[Any] = []  # each step's, for the loss audit (``step_losses``)
        with self._config(train=True):
            for start in range(0, len(order), bs):
                yb = self._feed(y[start:start + bs])
                loss, logits = self._step(self._feed(x[start:start + bs]), yb)
                losses.append(loss * len(yb))
                self._losses.append(loss)
                correct.append((logits.argmax(axis=-1) == yb).sum())  # a class per sample, or per position
        xp, n = self.xp, max(len(order), 1)
        return xp.stack(losses).sum() / n, xp.stack(correct).sum() / max(y.size, 1)

    def step_losses(self) -> Any:
        kept = getattr(self, "_losses", None)
        return None if kept is None else self.xp.stack([self.xp.asarray(v) for v in kept])

    def scores(self, x: Any, batch_size: int) -> Any:
        assert self.net is not None
        outs = []
        with self._config(train=False):
            for start in range(0, len(x), batch_size):
                xb = self._feed(x[start:start + batch_size])
                logits = self.net.forward(chainer.Variable(xb, requires_grad=False))
                outs.append((F.softmax(logits, axis=-1) if self.softmax_out else logits).array)
        if not outs:
            return self.xp.zeros((0, *self.net.graph.output.out_shape), np.float32)
        return self.xp.concatenate(outs)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        # Dropout off, in training mode: unit masks keep static-graph on its training schedule.
        losses = []
        with self._config(train=True):
            for xb, yb in batches:
                x, y = self._feed(self.to_device(xb)), self.device.send(np.asarray(yb, np.int32))
                loss, _ = self._step(x, y, unit_masks=True)
                losses.append(float(loss))
        return losses

    def train_scores(self, x: Any) -> Any:
        assert self.net is not None
        self.net.set_update(False)  # batch statistics, the moving ones left as they are
        try:
            with self._config(train=True), chainer.using_config("enable_backprop", False):
                logits = self.net.forward(chainer.Variable(self._feed(x), requires_grad=False),
                                          *self._masks(len(x), True))
        finally:
            self.net.set_update(True)
        return (F.softmax(logits, axis=-1) if self.softmax_out else logits).array

    def to_host(self, value: Any) -> Any:
        host = cuda.to_cpu(value) if self.gpu else value
        return host.item() if getattr(host, "ndim", None) == 0 else np.asarray(host)

    def sync(self) -> None:
        if self.gpu:
            cuda.cupy.cuda.get_current_stream().synchronize()
