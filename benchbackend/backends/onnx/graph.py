"""The workload's network as an ONNX graph, built from the spec with the ``onnx`` helper API.

Shared by the ONNX-consuming runtimes (onnxruntime, openvino, tvm), so that they all run one
graph and no framework's exporter decides what it contains. The graph takes the canonical input
(float32 NHWC ``[batch, H, W, C]``, or a language model's float token ids ``[batch, T]``;
``batch`` dynamic unless fixed) and returns class probabilities ``[batch, classes]``, or a
language model's ``[batch, T, vocab]`` (``output_shape``); the final softmax included, dropout
(the identity at inference) left out.

ONNX's Conv, MaxPool, BatchNormalization and pools are NCHW: an NHWC value is transposed once,
where an NCHW op first reads it; conv kernels go HWIO -> OIHW; every padding (TF 'same'
included) is explicit pads (MaxPool's never win a max); batchnorm is ONNX's inference-mode
BatchNormalization on the moving statistics (runtimes fold it into the conv); a dense layer (or
batchnorm) behind a flatten of NCHW activations gets its rows permuted to NCHW order.

A transformer's token sequences are ``[batch, T, d]`` (``onnx_transformer.py``: its layers, dense and
average pool on tokens; GELU with the other activations in ``onnx_nodes.py``, which both build on);
the conv's NCHW output becomes tokens in row-major (h, w) order. A decoder's embedding, RMSNorm,
causal mask, rotary positions, grouped heads and tied output are ``decoder.py``'s; ``multiply``
is an elementwise Mul.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import BackendUnavailable
from ...spec.graph import INPUT as GRAPH_INPUT
from ...spec.graph import Node, resolve
from ...spec.layers import (
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
from ...spec.model import nhwc_to_nchw_rows
from ...spec.workload import Workload
from . import transformer as onnx_transformer
from .nodes import Builder, Value

#: Opset 17 is read by onnxruntime, OpenVINO's ONNX frontend and TVM's Relax ONNX frontend alike.
OPSET = 17
#: IR version 8 goes with opset 17; a newer IR (onnx's default) is refused by older runtimes.
IR_VERSION = 8
INPUT = "x"
OUTPUT = "probs"


def _rows(v: Value) -> Optional[np.ndarray]:
    """The canonical rows of a flat value in NCHW feature order (None: canonical order already)."""
    return None if v.flat_from is None else nhwc_to_nchw_rows(*v.flat_from)


def _node(g: Builder, node: Node, ins: list[Value], w: list[np.ndarray]) -> Value:
    """The ONNX nodes of one graph node (before its activation)."""
    layer, tag = node.layer, f"n{node.index}.{node.kind}"
    if onnx_transformer.handles(node):
        return Value(onnx_transformer.node(g, node, ins[0], w))
    if isinstance(layer, Conv2D):
        (top, bottom), (left, right) = node.pads  # type: ignore[misc]
        args = [g.nchw(ins[0]), g.const(f"{tag}.weight", np.transpose(w[0], (3, 2, 0, 1)))]  # HWIO -> OIHW
        if layer.use_bias:
            args.append(g.const(f"{tag}.bias", w[1]))
        return Value(g.add("Conv", args, tag, kernel_shape=[layer.kernel_size] * 2, strides=[layer.stride] * 2,
                            pads=[top, left, bottom, right]), nchw=True)
    if isinstance(layer, MaxPool2D):
        (top, bottom), (left, right) = node.pads  # type: ignore[misc]
        # ONNX's MaxPool pads never win a max.
        return Value(g.add("MaxPool", [g.nchw(ins[0])], tag, kernel_shape=[layer.pool_size] * 2,
                            strides=[layer.stride or layer.pool_size] * 2, pads=[top, left, bottom, right]), nchw=True)
    if isinstance(layer, Dense):
        rows = _rows(ins[0])
        kernel = w[0] if rows is None else w[0][rows]
        bias = [g.const(f"{tag}.bias", w[1])] if layer.use_bias else []
        return Value(g.add("Gemm", [ins[0].name, g.const(f"{tag}.weight", kernel), *bias], tag))
    if isinstance(layer, BatchNorm):
        # Inference mode: the moving statistics (runtimes fold it into the conv before it).
        rank4 = len(node.in_shape) == 3
        rows = None if rank4 else _rows(ins[0])
        vec = [a if rows is None else a[rows] for a in w]
        names = [g.const(f"{tag}.{k}", a) for k, a in zip(("scale", "bias", "mean", "var"), vec)]
        x = g.nchw(ins[0]) if rank4 else ins[0].name
        return Value(g.add("BatchNormalization", [x, *names], tag, epsilon=layer.epsilon), nchw=rank4,
                      flat_from=ins[0].flat_from)
    if isinstance(layer, Add):
        if len(node.in_shape) == 3:
            names = [g.nchw(v) for v in ins]
        elif len({v.flat_from for v in ins}) == 1:
            names = [v.name for v in ins]
        else:
            raise BackendUnavailable(f"{node.label()}: adds a flattened image to other features; the ONNX graph "
                                     "flattens NCHW and cannot")
        return Value(g.add("Sum", names, tag), nchw=len(node.in_shape) == 3, flat_from=ins[0].flat_from)
    if isinstance(layer, Multiply):  # elementwise (a gated MLP's gate times its up projection)
        if len(node.in_shape) == 3:
            raise BackendUnavailable(f"{node.label()}: multiplies images; the ONNX graph multiplies tokens or features")
        out = ins[0].name
        for i, other in enumerate(ins[1:]):
            out = g.add("Mul", [out, other.name], tag if i == len(ins) - 2 else f"{tag}.{i}")
        return Value(out, flat_from=ins[0].flat_from)
    if isinstance(layer, GlobalAvgPool):
        pooled = g.add("GlobalAveragePool", [g.nchw(ins[0])], f"{tag}.pool")
        return Value(g.add("Flatten", [pooled], tag, axis=1))
    if isinstance(layer, Flatten):
        if len(node.in_shape) != 3:
            return ins[0]
        # The canonical dense rows follow NHWC flatten order; flattening NCHW needs them permuted.
        return Value(g.add("Flatten", [ins[0].name], tag, axis=1),
                      flat_from=node.in_shape if ins[0].nchw else None)  # type: ignore[arg-type]
    if isinstance(layer, (Dropout, ActivationLayer)):
        return ins[0]  # dropout is the identity at inference
    raise TypeError(f"{node.label()}: no ONNX translation")


def build_model(workload: Workload, weights: Sequence[np.ndarray],
                batch_size: Optional[int] = None) -> onnx.ModelProto:
    """The network of ``workload`` with ``weights`` (canonical layout) as a checked ONNX model.

    ``batch_size``: None for a dynamic batch dimension, else a fixed one.
    """
    graph = resolve(workload)
    if len(weights) != graph.n_weights:
        raise ValueError(f"the model has {graph.n_weights} weight arrays; got {len(weights)}")
    g = Builder()
    values: dict[int, Value] = {GRAPH_INPUT: Value(INPUT)}
    for node in graph.nodes:
        out = _node(g, node, [values[j] for j in node.inputs], graph.weights_of(node, weights))
        values[node.index] = g.activation(node.activation, out, f"n{node.index}.{node.activation}",
                                          len(node.out_shape) + 1, gelu_approximate(node.layer))
    last = values[graph.output.index]
    if last.nchw:
        raise ValueError("the network's output is an image; it must be one score per class")
    g.add("Identity", [last.name], OUTPUT)

    batch: int | str = batch_size if batch_size is not None else "batch"
    proto = helper.make_graph(
        g.nodes, workload.name,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, *workload.input_shape])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, *output_shape(workload)])],
        initializer=g.inits)
    model = helper.make_model(proto, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="benchbackend", ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def output_shape(workload: Workload) -> tuple[int, ...]:
    """One sample's scores: ``(classes,)``, or a language model's ``(T, vocab)`` (one row per position)."""
    return tuple(resolve(workload).output.out_shape)


def model_bytes(workload: Workload, weights: Sequence[np.ndarray], batch_size: Optional[int] = None) -> bytes:
    """:func:`build_model`, serialized (what ``InferenceSession`` and ``read_model`` take)."""
    return build_model(workload, weights, batch_size).SerializeToString()


def param_count(model: onnx.ModelProto) -> int:
    """Number of weights the graph carries (its float initializers; constants are ``Constant`` nodes)."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)

