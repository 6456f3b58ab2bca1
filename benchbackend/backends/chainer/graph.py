"""The resolved graph (``benchbackend.spec.graph``) as a ``chainer.Chain`` (NCHW), in the harness' conventions.

Where Chainer's defaults differ from the reference's, this module converts:

- TF 'same' and asymmetric padding: an explicit ``F.pad`` (Chainer pads symmetrically); a
  max-pool's pads are ``-inf`` (``F.max_pooling_2d`` pads so itself; ``cover_all=False``: Keras
  drops a partial window, Chainer's default keeps it);
- batchnorm (:class:`BatchNormKeras`): ``L.BatchNormalization`` updates its running variance with
  the *unbiased* batch variance and calls the momentum ``decay``; here the batch statistics go
  through ``F.batch_normalization`` without running statistics, and the moving ones are updated
  with Keras' momentum and the biased variance;
- Nesterov's SGD (:class:`KerasNesterov`): Chainer's ``NesterovAG`` steps by
  ``momentum**2 * v - (1 + momentum) * lr * g`` with the new ``v``, Keras by ``momentum * v - lr * g``;
- the transformer layers: ``chainer_transformer`` (a dense layer on tokens is ``L.Linear`` on the
  last axis, ``n_batch_axes=2``);
- attention (a ViT's, or a decoder's with a causal mask, grouped key/value heads, rotary positions
  or no biases) and the decoder's other layers (embedding, rmsnorm, a dense layer tied to an
  embedding): ``decoder.py``; ``silu`` is ``x * sigmoid(x)``, ``multiply`` the inputs' elementwise
  product, and a dense layer with ``use_bias: false`` an ``L.Linear`` without one.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Iterator

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
from chainer.optimizers.momentum_sgd import MomentumSGD, MomentumSGDRule

from ...spec import layers
from ...spec.graph import INPUT, Graph, Node
from ...spec.layers import (
    TOKEN_LAYERS,
    ActivationLayer,
    Add,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool2D,
    Multiply,
    gelu_approximate,
)
from .decoder import decoder_op
from .transformer import TokenLink, gelu, token_op

_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "relu": F.relu, "tanh": F.tanh, "sigmoid": F.sigmoid, "softmax": lambda h: F.softmax(h, axis=1),
    "silu": lambda h: h * F.sigmoid(h)}
Op = Callable[[list, Iterator[Any]], Any]


def _nchw_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[2], shape[0], shape[1]) if len(shape) == 3 else shape


class BatchNormKeras(chainer.Link):
    """Batchnorm over every axis but the channels (axis 1): batch statistics in training (the
    moving ones updated with Keras' momentum and the biased variance, unless ``update`` is off),
    the moving statistics in test mode."""

    def __init__(self, size: int, momentum: float, epsilon: float):
        super().__init__()
        with self.init_scope():
            self.gamma = chainer.Parameter(np.ones(size, np.float32))
            self.beta = chainer.Parameter(np.zeros(size, np.float32))
        self.avg_mean = np.zeros(size, np.float32)
        self.avg_var = np.ones(size, np.float32)
        self.register_persistent("avg_mean")
        self.register_persistent("avg_var")
        self.momentum, self.epsilon, self.update = momentum, epsilon, True

    def forward(self, x: Any) -> Any:
        if not chainer.config.train:
            return F.fixed_batch_normalization(x, self.gamma, self.beta, self.avg_mean, self.avg_var, self.epsilon)
        if self.update:
            a = x.array if isinstance(x, chainer.Variable) else x
            axes = (0,) + tuple(range(2, a.ndim))
            mean = a.mean(axis=axes)
            var = ((a - mean.reshape((1, -1) + (1,) * (a.ndim - 2))) ** 2).mean(axis=axes)
            m = self.momentum
            self.avg_mean *= m
            self.avg_mean += (1 - m) * mean
            self.avg_var *= m
            self.avg_var += (1 - m) * var
        return F.batch_normalization(x, self.gamma, self.beta, eps=self.epsilon)


class _KerasNesterovRule(MomentumSGDRule):
    def update_core_cpu(self, param: Any) -> None:
        grad = param.grad
        if grad is None:
            return
        v, lr, m = self.state["v"], self.hyperparam.lr, self.hyperparam.momentum
        v *= m
        v -= lr * grad
        param.data += m * v - lr * grad

    update_core_gpu = update_core_cpu  # element-wise, the same on CuPy arrays


class KerasNesterov(MomentumSGD):
    """SGD with Nesterov momentum in Keras' formula: ``v = m * v - lr * g; w += m * v - lr * g``."""

    def create_update_rule(self) -> Any:
        return _KerasNesterovRule(self.hyperparam)


class GraphChain(chainer.Chain):
    """The graph's nodes as links and functions; ``body`` returns the logits (before a final softmax).

    Dropout comes in two forms. Define-by-run uses ``F.dropout``. Under ``static_graph`` a
    replayed schedule re-runs each function's ``forward`` on the *same* FunctionNode, and
    ``F.dropout`` keeps the mask it drew first: every later step would drop the same units. So
    in static-graph mode the masks are drawn outside the static chain each step and passed in as
    inputs (the schedule copies new inputs in); in test mode no masks are passed and dropout is
    the identity.
    """

    def __init__(self, graph: Graph):
        super().__init__()
        self.graph = graph
        #: (rate, NCHW shape per sample) of each dropout layer, in order.
        self.dropouts: list[tuple[float, tuple[int, ...]]] = []
        #: Per node, the links holding its weights (canonical order).
        self.holders: list[Any] = []
        last = graph.output.index
        with self.init_scope():
            self.ops = [self._op(node, last) for node in graph.nodes]
        last_use = {j: i for i, node in enumerate(graph.nodes) for j in node.inputs}
        self.free_after = [[j for j, n in last_use.items() if n == i and j != INPUT] for i in range(len(graph.nodes))]

    def _op(self, node: Node, last: int) -> Op:
        i = node.index
        fn = "none" if i == last and node.activation == "softmax" else node.activation
        act = _ACTIVATIONS.get(fn)
        if fn == "gelu":
            act = functools.partial(gelu, approximate=gelu_approximate(node.layer))
        elif fn == "softmax" and len(node.out_shape) == 2:  # tokens (N, T, d): over d
            act = functools.partial(F.softmax, axis=2)
        op = self._layer_op(node)
        self.holders.append(getattr(self, f"l{i}", None))
        return op if act is None else (lambda ins, masks, op=op, act=act: act(op(ins, masks)))

    def _layer_op(self, node: Node) -> Op:
        layer, i = node.layer, node.index
        if isinstance(layer, Conv2D):
            (top, bottom), (left, right) = node.pads
            link = L.Convolution2D(node.in_shape[2], layer.filters, layer.kernel_size, layer.stride, pad=0,
                                   nobias=not layer.use_bias)
            setattr(self, f"l{i}", link)
            if top == bottom and left == right:
                link.pad = (top, left)
                return lambda ins, masks: link(ins[0])
            widths = ((0, 0), (0, 0), (top, bottom), (left, right))  # TF puts the odd pixel after
            return lambda ins, masks: link(F.pad(ins[0], widths, "constant"))
        if (isinstance(layer, (layers.Embedding, layers.RMSNorm, layers.Attention))
                or (isinstance(layer, Dense) and node.tied is not None)):
            holder, op = decoder_op(node, self.holders)
            setattr(self, f"l{i}", holder)
            return op
        if isinstance(layer, Dense):
            link = L.Linear(node.in_shape[-1], layer.units, nobias=not layer.use_bias)
            setattr(self, f"l{i}", link)
            axes = len(node.in_shape)  # 2 on tokens (N, T, d): the last axis
            return lambda ins, masks: link(ins[0], n_batch_axes=axes)
        if isinstance(layer, TOKEN_LAYERS):
            holder, op = token_op(node)
            if holder is not None:
                setattr(self, f"l{i}", holder)
            return op
        if isinstance(layer, BatchNorm):
            link = BatchNormKeras(node.in_shape[-1], layer.momentum, layer.epsilon)
            setattr(self, f"l{i}", link)
            return lambda ins, masks: link(ins[0])
        if isinstance(layer, MaxPool2D):
            return self._pool(node)
        if isinstance(layer, Add):
            return lambda ins, masks: sum(ins[1:], ins[0])
        if isinstance(layer, Multiply):
            return lambda ins, masks: functools.reduce(operator.mul, ins)
        if isinstance(layer, GlobalAvgPool):
            axes = 1 if len(node.in_shape) == 2 else (2, 3)  # over the tokens, or over H and W
            return lambda ins, masks: F.average(ins[0], axis=axes)
        if isinstance(layer, Dropout):
            self.dropouts.append((layer.rate, _nchw_shape(node.in_shape)))
            return self._dropout(layer.rate)
        if isinstance(layer, Flatten):
            return lambda ins, masks: F.reshape(ins[0], (ins[0].shape[0], -1))  # NCHW order: rows permuted
        if isinstance(layer, ActivationLayer):
            return lambda ins, masks: ins[0]
        raise TypeError(f"{node.label()}: no Chainer translation")

    @staticmethod
    def _pool(node: Node) -> Op:
        layer = node.layer
        k, s = layer.pool_size, layer.stride or layer.pool_size
        (top, bottom), (left, right) = node.pads
        if top == bottom and left == right:
            return lambda ins, masks: F.max_pooling_2d(ins[0], k, s, pad=(top, left), cover_all=False)
        widths = ((0, 0), (0, 0), (top, bottom), (left, right))
        return lambda ins, masks: F.max_pooling_2d(F.pad(ins[0], widths, "constant", constant_values=-np.inf), k, s,
                                                   cover_all=False)

    @staticmethod
    def _dropout(rate: float) -> Op:
        def apply(ins: list, masks: Iterator[Any]) -> Any:
            mask = next(masks, None)
            return F.dropout(ins[0], rate) if mask is None else ins[0] * mask  # F.dropout: identity in test mode
        return apply

    def body(self, x: Any, *masks: Any) -> Any:
        values: dict[int, Any] = {INPUT: x}
        it, out = iter(masks), x
        for i, (node, op) in enumerate(zip(self.graph.nodes, self.ops)):
            out = op([values[j] for j in node.inputs], it)
            values[i] = out
            for j in self.free_after[i]:
                del values[j]
        return out

    def arrays(self) -> list[Any]:
        """Every weight array (parameters and moving statistics), canonical order, NCHW layouts."""
        out: list[Any] = []
        for link in self.holders:
            if isinstance(link, BatchNormKeras):
                out += [link.gamma.array, link.beta.array, link.avg_mean, link.avg_var]
            elif isinstance(link, TokenLink):
                out += link.arrays()
            elif link is not None:
                out += [link.W.array] + ([link.b.array] if link.b is not None else [])
        return out

    def transposed(self) -> list[bool]:
        """Per array of ``arrays``: is it the transpose of ``model.to_nchw_weights``' array (attention's kernels)?"""
        out: list[bool] = []
        for link in self.holders:
            if isinstance(link, TokenLink):
                out += link.TRANSPOSED
            elif isinstance(link, BatchNormKeras):
                out += [False] * 4
            elif link is not None:
                out += [False] * (1 + (link.b is not None))
        return out

    def kernels(self) -> list[Any]:
        """The weights that weight decay reaches: conv, dense and attention kernels."""
        out = []
        for link in self.holders:
            if isinstance(link, (L.Convolution2D, L.Linear)):
                out.append(link.W)
            elif isinstance(link, TokenLink):
                out += link.kernels()
        return out

    def set_update(self, update: bool) -> None:
        for link in self.holders:
            if isinstance(link, BatchNormKeras):
                link.update = update
