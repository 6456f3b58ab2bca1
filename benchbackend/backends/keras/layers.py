"""The resolved graph as a Keras functional model, shared by Keras 3 (tensorflow, keras-jax,
keras-torch) and Keras 2.2.4 (plaidml).

Imports no framework: the caller passes its ``keras`` module (and, for a dtype policy, a layers
namespace). Keras' own conventions are the canonical ones (NHWC, HWIO kernels, TF 'same' padding,
batchnorm's momentum, epsilon and biased moving variance in Keras 3, weights in Keras' order), so
the translation is one Keras layer per spec layer, plus:

- ``ZeroPadding2D`` before a conv whose padding is not ``same``/``valid``;
- a max-pool whose padding is not TF's ``same`` pads with ``-inf`` (``neg_pad``; a backend
  without one raises ``BackendUnavailable``);
- an ``Activation`` after a batchnorm or an add that carries one;
- ``kernel_regularizer=L2(rate)`` on conv, dense and attention kernels for an ``l2`` weight decay;
- the transformer layers through a ``transformer`` kit (``keras_transformer.py`` for Keras 3),
  which also resolves GELU in the spec's form; ``global_avgpool`` over tokens is
  ``GlobalAveragePooling1D``.

The weights are set and read layer by layer (``KerasNet.set``/``get``), never through
``model.set_weights``: a functional model orders its layers by depth, so a projection shortcut
would come before the main path's layers and out of the spec's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ...errors import BackendUnavailable
from ...spec.graph import INPUT, Graph, Node, resolve, resolve_pads
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
from ...spec.workload import Workload

#: ``neg_pad(pads)``: a layer that pads ((top, bottom), (left, right)) with -inf.
NegPad = Callable[[tuple[tuple[int, int], tuple[int, int]]], Any]


@dataclass
class KerasNet:
    """The functional model and, per spec node, the Keras layer that holds its weights (or None)."""

    model: Any
    holders: list[Any]
    graph: Graph

    def set(self, weights: Sequence[Any]) -> None:
        for node, layer in zip(self.graph.nodes, self.holders):
            if layer is not None:
                layer.set_weights(list(self.graph.weights_of(node, weights)))

    def get(self) -> list[Any]:
        return [w for layer in self.holders if layer is not None for w in layer.get_weights()]

    def batchnorms(self) -> list[Any]:
        return [layer for node, layer in zip(self.graph.nodes, self.holders) if isinstance(node.layer, BatchNorm)]


def _act(name: str, layer: Any = None, transformer: Any = None) -> Any:
    """Keras' activation for ``name``: GELU in the spec's form, from the transformer kit."""
    if name == "gelu":
        if transformer is None:
            raise BackendUnavailable("no GELU in this Keras (the gelu activation)")
        return transformer.gelu(gelu_approximate(layer))
    return None if name == "none" else name


def build(workload: Workload, keras: Any, L: Any = None, *, dropout: bool = True,
          batchnorm: Optional[Callable[..., Any]] = None, neg_pad: Optional[NegPad] = None,
          regularizer: Optional[Callable[[float], Any]] = None, output_dtype: Optional[str] = None,
          transformer: Any = None) -> KerasNet:
    """The workload's network. ``L``: the layers namespace (default ``keras.layers``); ``dropout``
    False leaves dropout out (the trajectory check); ``batchnorm``: the batchnorm layer class
    (default ``L.BatchNormalization``); ``regularizer(rate)``: the L2 kernel regularizer;
    ``output_dtype``: the final softmax as its own ``Activation`` of that dtype (mixed precision);
    ``transformer``: the kit that builds the token layers and GELU (``keras_transformer``), None
    where this Keras has none."""
    L = L or keras.layers
    g = resolve(workload)
    decay = workload.training.weight_decay
    reg = regularizer(decay.rate) if regularizer is not None and decay is not None and decay.kind == "l2" else None
    if decay is not None and decay.kind == "l2" and regularizer is None:
        raise BackendUnavailable("no L2 kernel regularizer given for weight_decay l2")
    x = keras.layers.Input(shape=tuple(workload.input_shape))
    values: dict[int, Any] = {INPUT: x}
    holders: list[Any] = []
    for node in g.nodes:
        ins = [values[j] for j in node.inputs]
        last = node is g.output
        act = node.activation
        if last and output_dtype is not None and act == "softmax":
            act = "none"
        if isinstance(node.layer, Dense) and node.tied is not None:
            if transformer is None:
                raise BackendUnavailable(f"{node.label()}: no tied dense layer in this Keras")
            holder_of = {n.index: h for n, h in zip(g.nodes, holders)}
            out, holder = transformer.tied(node, ins[0], holder_of[node.tied], _act(act, node.layer, transformer))
        elif isinstance(node.layer, TOKEN_LAYERS):
            if transformer is None:
                raise BackendUnavailable(f"{node.label()}: no transformer layers in this Keras")
            out, holder = transformer.layer(node, ins[0], L, reg)
        else:
            out, holder = _layer(node, ins, L, _act(act, node.layer, transformer), dropout, workload.seed,
                                 batchnorm or L.BatchNormalization, neg_pad, reg)
        if last and output_dtype is not None and node.activation == "softmax":
            out = keras.layers.Activation("softmax", dtype=output_dtype)(out)
        values[node.index] = out
        holders.append(holder)
    return KerasNet(keras.models.Model(x, values[g.output.index]), holders, g)


def _layer(node: Node, ins: list[Any], L: Any, act: Any, dropout: bool, seed: int, batchnorm: Any,
           neg_pad: Optional[NegPad], reg: Any) -> tuple[Any, Any]:
    """(output tensor, the layer holding the node's weights or None)."""
    layer, x = node.layer, ins[0]
    if isinstance(layer, Conv2D):
        padding = layer.padding if layer.padding in ("same", "valid") else "valid"
        if padding == "valid" and node.pads != ((0, 0), (0, 0)):
            x = L.ZeroPadding2D(node.pads)(x)
        conv = L.Conv2D(layer.filters, layer.kernel_size, strides=layer.stride, padding=padding,
                        use_bias=layer.use_bias, activation=act, kernel_regularizer=reg)
        return conv(x), conv
    if isinstance(layer, MaxPool2D):
        stride = layer.stride or layer.pool_size
        h, w = node.in_shape[:2]
        if node.pads == ((0, 0), (0, 0)):
            padding = "valid"
        elif node.pads == resolve_pads("same", h, w, layer.pool_size, stride):
            padding = "same"  # TF's 'same' max-pool pads with -inf
        elif neg_pad is None:
            raise BackendUnavailable(f"{node.label()}: max-pool padding {layer.padding} needs -inf pads, which "
                                     "this Keras cannot express")
        else:
            x, padding = neg_pad(node.pads)(x), "valid"
        return L.MaxPooling2D(layer.pool_size, strides=stride, padding=padding)(x), None
    if isinstance(layer, Dense):
        dense = L.Dense(layer.units, activation=act, use_bias=layer.use_bias, kernel_regularizer=reg)
        return dense(x), dense
    if isinstance(layer, BatchNorm):
        bn = batchnorm(momentum=layer.momentum, epsilon=layer.epsilon)
        return _then(L, bn(x), act), bn
    if isinstance(layer, Add):
        return _then(L, L.Add()(ins), act), None
    if isinstance(layer, Multiply):
        return L.Multiply()(ins), None
    if isinstance(layer, GlobalAvgPool):
        pool = L.GlobalAveragePooling1D if len(node.in_shape) == 2 else L.GlobalAveragePooling2D
        return pool()(x), None
    if isinstance(layer, Dropout):
        return (L.Dropout(layer.rate, seed=seed)(x) if dropout else x), None
    if isinstance(layer, Flatten):
        return L.Flatten()(x), None
    if isinstance(layer, ActivationLayer):
        return L.Activation(act or "linear")(x), None
    raise TypeError(f"{node.label()}: no Keras translation")


def _then(L: Any, x: Any, act: Any) -> Any:
    return x if act is None else L.Activation(act)(x)


# --- Keras 3 only (tensorflow, keras-jax, keras-torch) -------------------------------------------
def keras3_neg_pad(keras: Any) -> NegPad:
    """Keras 3's -inf padding for a max-pool (``keras.ops.pad`` in a ``Lambda``)."""
    def make(pads: tuple[tuple[int, int], tuple[int, int]]) -> Any:
        widths = ((0, 0), *pads, (0, 0))
        return keras.layers.Lambda(lambda v: keras.ops.pad(v, widths, constant_values=float("-inf")))
    return make


def keras3_build(workload: Workload, keras: Any, L: Any = None, dtype: Optional[str] = None,
                 **kwargs: Any) -> KerasNet:
    """:func:`build` with Keras 3's L2 regularizer, -inf padding and transformer layers; ``dtype``:
    the dtype policy of the transformer's own layers (``L`` makes the others under it)."""
    from .transformer import keras3_kit

    return build(workload, keras, L, regularizer=keras.regularizers.L2, neg_pad=keras3_neg_pad(keras),
                 transformer=keras3_kit(keras, dtype), **kwargs)


def keras3_optimizer(keras: Any, workload: Workload, net: KerasNet) -> Any:
    """The workload's optimizer as Keras 3's own; a decoupled weight decay is its ``weight_decay``,
    on the kernels only (``model.kernel_mask``: conv, dense and attention kernels; a holder's
    ``weights`` come in the canonical order)."""
    t = workload.training
    decay = t.weight_decay
    wd = decay.rate if decay is not None and decay.kind == "decoupled" else None
    if t.optimizer == "sgd":
        opt = keras.optimizers.SGD(learning_rate=t.lr, momentum=t.momentum, nesterov=t.nesterov, weight_decay=wd)
    elif t.optimizer == "adam":
        opt = keras.optimizers.Adam(learning_rate=t.lr, weight_decay=wd)
    else:
        opt = keras.optimizers.RMSprop(learning_rate=t.lr, weight_decay=wd)
    if wd is not None:
        kernels = {id(v) for node, layer in zip(net.graph.nodes, net.holders) if layer is not None
                   for v, kernel in zip(layer.weights, node.kernel, strict=True) if kernel}
        opt.exclude_from_weight_decay(var_list=[v for v in net.model.trainable_variables if id(v) not in kernels])
    return opt
