"""A workload's ``model`` resolved once into a graph: one typed, frozen :class:`Node` per layer.

Every consumer (the NumPy reference, each adapter, the ONNX and Relax builders, the parameter
and FLOP counts) walks this one description; none re-derives a shape or a padding.

A layer reads the previous layer's output unless it names ``inputs``; ``input`` is the network
input and the last layer is the output. Names are resolved here, and every problem is a
``ValueError`` of one line that names the layer: an unknown or later name, a duplicate, a cycle,
an ``add`` whose inputs differ in shape, a layer that does not fit its input, an output that
nothing reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .layers import (
    INPUT_NAME,
    TOKEN_LAYERS,
    ActivationLayer,
    Add,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    MaxPool2D,
    Multiply,
    activation_of,
)
from .transformer import node_fields

if TYPE_CHECKING:
    from .workload import Workload

Shape = tuple[int, ...]
Pads = tuple[tuple[int, int], tuple[int, int]]
#: The producer index of the network input in ``Node.inputs``.
INPUT = -1


@dataclass(frozen=True)
class Node:
    """One layer of the resolved graph.

    ``inputs``: producer indices (``INPUT`` for the network input). ``weights``: the canonical
    shapes of this layer's weight arrays, in Keras' order, with ``trainable`` and ``kernel``
    flags per array. ``pads``: conv2d/maxpool2d padding as ((top, bottom), (left, right)).
    ``flat_from``: for a rank-1 output that is a flattened image (through shape-keeping dropout
    and activation layers), that image's (H, W, C): NCHW frameworks permute the next dense kernel.
    ``tied``: for a dense layer with ``tied_to``, the index of the embedding whose table it reads
    as its kernel (transposed); its own ``weights`` are then only its bias, if any.
    """

    index: int
    layer: Any
    inputs: tuple[int, ...]
    in_shapes: tuple[Shape, ...]
    out_shape: Shape
    weights: tuple[Shape, ...] = ()
    trainable: tuple[bool, ...] = ()
    kernel: tuple[bool, ...] = ()
    flops: int = 0  # forward FLOPs per sample, a multiply-add counted as 2
    pads: Optional[Pads] = None
    flat_from: Optional[tuple[int, int, int]] = None
    tied: Optional[int] = None

    @property
    def kind(self) -> str:
        return self.layer.type

    @property
    def in_shape(self) -> Shape:
        return self.in_shapes[0]

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.weights)

    @property
    def activation(self) -> str:
        return activation_of(self.layer)

    def label(self) -> str:
        """``model[3] conv2d 'res2a'``: how an error names this layer."""
        return _label(self.index, self.layer)


@dataclass(frozen=True)
class Graph:
    """The resolved network: ``nodes`` in spec order (a topological order), and ``offsets[i]``,
    where node i's weights start in the flat canonical weight list."""

    input_shape: Shape
    nodes: tuple[Node, ...]
    offsets: tuple[int, ...]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    @property
    def n_weights(self) -> int:
        return self.offsets[-1] + len(self.nodes[-1].weights) if self.nodes else 0

    def weights_of(self, node: Node, flat: Sequence[Any]) -> list[Any]:
        """Node ``node``'s arrays out of the flat weight list."""
        start = self.offsets[node.index]
        return list(flat[start:start + len(node.weights)])

    def weight_shapes(self) -> list[Shape]:
        return [s for n in self.nodes for s in n.weights]

    def consumers(self) -> list[list[int]]:
        """For each node, the nodes that read its output (in order; one per reading)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for j in n.inputs:
                if j != INPUT:
                    out[j].append(n.index)
        return out

    def ends_in_softmax(self) -> bool:
        return bool(self.nodes) and self.output.activation == "softmax"


def resolve(workload: "Workload") -> Graph:
    """The workload's graph; its output must be one score per class, or for a language model
    (``workload.next_token``) one row of scores over the vocabulary per input token."""
    g = resolve_layers(workload.model, workload.input_shape)
    if workload.next_token:
        want = (workload.input_shape[0], workload.num_classes)
        if g.output.out_shape != want:
            raise ValueError(f"the model's output shape is {_shape(g.output.out_shape)}; it must be "
                             f"{_shape(want)}, one row of next-token scores over the vocabulary per token")
    elif g.output.out_shape != (workload.num_classes,):
        raise ValueError(f"the model's output shape is {_shape(g.output.out_shape)}; it must be "
                         f"({workload.num_classes},), one score per class")
    return g


def resolve_layers(layers: Sequence[Any], input_shape: Sequence[int]) -> Graph:
    """The graph of ``layers`` on inputs of ``input_shape`` (one sample, NHWC)."""
    names = _names(layers)
    nodes: list[Node] = []
    offsets, offset = [], 0
    for i, layer in enumerate(layers):
        inputs = _inputs(i, layer, names)
        shapes = tuple(tuple(input_shape) if j == INPUT else nodes[j].out_shape for j in inputs)
        node = _node(i, layer, inputs, shapes, [None if j == INPUT else nodes[j] for j in inputs])
        if isinstance(layer, Dense) and layer.tied_to is not None:
            node = _tie(node, names, nodes)
        nodes.append(node)
        offsets.append(offset)
        offset += len(node.weights)
    read = {j for n in nodes for j in n.inputs}
    for n in nodes[:-1]:
        if n.index not in read:
            raise ValueError(f"{n.label()}: its output is never used (only the last layer is the network's output)")
    return Graph(tuple(input_shape), tuple(nodes), tuple(offsets))


# --- names and inputs ------------------------------------------------------------------------------
def _label(i: int, layer: Any) -> str:
    return f"model[{i}] {layer.type}" + (f" '{layer.name}'" if layer.name else "")


def _shape(shape: Shape) -> str:
    """``(784,)``, ``(32, 32, 3)``: as Python prints a tuple, and as every other message does."""
    return str(tuple(int(n) for n in shape))


def _names(layers: Sequence[Any]) -> dict[str, int]:
    names: dict[str, int] = {}
    for i, layer in enumerate(layers):
        if layer.name is None:
            continue
        if layer.name == INPUT_NAME:
            raise ValueError(f"{_label(i, layer)}: the name '{INPUT_NAME}' is the network input's")
        if layer.name in names:
            raise ValueError(f"{_label(i, layer)}: duplicate name, already model[{names[layer.name]}]'s")
        names[layer.name] = i
    return names


def _inputs(i: int, layer: Any, names: dict[str, int]) -> tuple[int, ...]:
    if layer.inputs is None:
        if isinstance(layer, (Add, Multiply)):
            raise ValueError(f"{_label(i, layer)}: needs `inputs`, two or more layer names")
        return (i - 1 if i > 0 else INPUT,)
    out = []
    for name in layer.inputs:
        if name == INPUT_NAME:
            out.append(INPUT)
        elif name not in names:
            raise ValueError(f"{_label(i, layer)}: no layer is named '{name}'")
        elif names[name] == i:
            raise ValueError(f"{_label(i, layer)}: reads its own output (a cycle)")
        elif names[name] > i:
            raise ValueError(f"{_label(i, layer)}: input '{name}' is model[{names[name]}], a later layer "
                             "(inputs must come earlier: a graph without cycles)")
        else:
            out.append(names[name])
    if isinstance(layer, (Add, Multiply)) and len(out) < 2:
        raise ValueError(f"{_label(i, layer)}: needs two or more inputs; got {len(out)}")
    if not isinstance(layer, (Add, Multiply)) and len(out) != 1:
        raise ValueError(f"{_label(i, layer)}: takes one input; got {len(out)}")
    return tuple(out)


# --- shapes, weights, FLOPs ------------------------------------------------------------------------
def same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow/Keras 'same' padding: (before, after); the extra pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def resolve_pads(padding: Any, h: int, w: int, kernel: int, stride: int) -> Pads:
    """A layer's ``padding`` field as ((top, bottom), (left, right))."""
    if padding == "same":
        return same_pads(h, kernel, stride), same_pads(w, kernel, stride)
    if padding == "valid":
        return (0, 0), (0, 0)
    if isinstance(padding, int):
        return (padding, padding), (padding, padding)
    (t, b), (left, r) = padding
    return (int(t), int(b)), (int(left), int(r))


def window_out(size: int, pads: tuple[int, int], kernel: int, stride: int) -> int:
    """Output length of a window of ``kernel`` at ``stride`` over ``size`` padded by ``pads``."""
    return (size + pads[0] + pads[1] - kernel) // stride + 1


def _image(node_label: str, shape: Shape) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(f"{node_label} needs an image input (H, W, C), got shape {_shape(shape)}")
    return shape  # type: ignore[return-value]


def _windowed(label: str, layer: Any, shape: Shape, kernel: int, stride: int) -> tuple[Pads, int, int]:
    h, w, _ = _image(label, shape)
    pads = resolve_pads(layer.padding, h, w, kernel, stride)
    ho, wo = window_out(h, pads[0], kernel, stride), window_out(w, pads[1], kernel, stride)
    if ho <= 0 or wo <= 0:
        what = f"kernel {kernel}" if isinstance(layer, Conv2D) else f"pool {kernel}"
        raise ValueError(f"{label} {what} does not fit input {_shape(shape)} (padding {layer.padding})")
    return pads, ho, wo


def _node(i: int, layer: Any, inputs: tuple[int, ...], shapes: tuple[Shape, ...],
          producers: list[Optional[Node]]) -> Node:
    label, shape = _label(i, layer), shapes[0]
    base = dict(index=i, layer=layer, inputs=inputs, in_shapes=shapes)
    if isinstance(layer, Conv2D):
        k, c = layer.kernel_size, _image(label, shape)[2]
        pads, ho, wo = _windowed(label, layer, shape, k, layer.stride)
        weights = ((k, k, c, layer.filters),) + (((layer.filters,),) if layer.use_bias else ())
        return Node(**base, out_shape=(ho, wo, layer.filters), weights=weights, trainable=(True,) * len(weights),
                    kernel=(True, False)[:len(weights)], flops=2 * k * k * c * layer.filters * ho * wo, pads=pads)
    if isinstance(layer, MaxPool2D):
        stride = layer.stride or layer.pool_size
        pads, ho, wo = _windowed(label, layer, shape, layer.pool_size, stride)
        if max(max(pads[0]), max(pads[1])) >= layer.pool_size:
            raise ValueError(f"{label}: padding {layer.padding} must be smaller than the pool size {layer.pool_size}")
        return Node(**base, out_shape=(ho, wo, shape[2]), flops=math.prod(shape), pads=pads)
    if isinstance(layer, TOKEN_LAYERS):
        return Node(**base, **node_fields(label, layer, shape))
    if isinstance(layer, Dense):  # on a flat input, or on the last axis of a token sequence (T, d)
        if len(shape) not in (1, 2):
            raise ValueError(f"{label} needs a flat input (add a flatten layer) or a token sequence (T, d), "
                             f"got shape {_shape(shape)}")
        weights = ((shape[-1], layer.units),) + (((layer.units,),) if layer.use_bias else ())
        return Node(**base, out_shape=shape[:-1] + (layer.units,), weights=weights, trainable=(True,) * len(weights),
                    kernel=(True, False)[:len(weights)], flops=2 * math.prod(shape) * layer.units)
    if isinstance(layer, BatchNorm):
        c = shape[-1]
        return Node(**base, out_shape=shape, weights=((c,),) * 4, trainable=(True, True, False, False),
                    kernel=(False,) * 4, flops=2 * math.prod(shape), flat_from=_flat(producers[0]))
    if isinstance(layer, (Add, Multiply)):
        for j, s in zip(inputs[1:], shapes[1:]):
            if s != shape:
                raise ValueError(f"{label}: inputs {_ref(inputs[0], producers[0])} {_shape(shape)} and "
                                 f"{_ref(j, producers[inputs.index(j)])} {_shape(s)} differ")
        flats = {_flat(p) for p in producers}
        return Node(**base, out_shape=shape, flops=(len(inputs) - 1) * math.prod(shape),
                    flat_from=flats.pop() if len(flats) == 1 else None)
    if isinstance(layer, GlobalAvgPool):  # over the pixels of an image, or over the tokens of a sequence
        if len(shape) != 2:
            _image(label, shape)
        return Node(**base, out_shape=(shape[-1],), flops=math.prod(shape))
    if isinstance(layer, Flatten):
        return Node(**base, out_shape=(math.prod(shape),), flat_from=shape if len(shape) == 3 else _flat(producers[0]))
    if isinstance(layer, (Dropout, ActivationLayer)):
        return Node(**base, out_shape=shape, flat_from=_flat(producers[0]))
    raise TypeError(f"{label}: unknown layer {layer!r}")


def _tie(node: Node, names: dict[str, int], nodes: list[Node]) -> Node:
    """A dense layer whose kernel is an earlier embedding's table, transposed: its weights are its
    bias alone (if any); the table stays the embedding's one array."""
    layer, label = node.layer, node.label()
    j = names.get(layer.tied_to)
    if j is None or j >= node.index:
        raise ValueError(f"{label}: `tied_to` '{layer.tied_to}' must name an earlier embedding layer")
    emb = nodes[j].layer
    if not isinstance(emb, Embedding):
        raise ValueError(f"{label}: `tied_to` '{layer.tied_to}' is a {emb.type} layer; it must be an embedding")
    if (node.in_shape[-1], layer.units) != (emb.width, emb.vocab):
        raise ValueError(f"{label}: tied to '{layer.tied_to}' ({emb.vocab} x {emb.width}), it needs inputs of width "
                         f"{emb.width} and {emb.vocab} units; got width {node.in_shape[-1]} and {layer.units} units")
    bias = ((layer.units,),) if layer.use_bias else ()
    return replace(node, weights=bias, trainable=(True,) * len(bias), kernel=(False,) * len(bias), tied=j)


def _flat(producer: Optional[Node]) -> Optional[tuple[int, int, int]]:
    return None if producer is None else producer.flat_from


def _ref(j: int, producer: Optional[Node]) -> str:
    if producer is None:
        return INPUT_NAME
    return producer.layer.name or f"model[{j}]"
