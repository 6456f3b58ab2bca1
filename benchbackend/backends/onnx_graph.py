"""The workload's network as an ONNX graph, built from the spec with the ``onnx`` helper API.

Shared by the ONNX-consuming runtimes (onnxruntime, openvino, tvm), so that they all run one
graph and no framework's exporter decides what it contains. The graph takes the canonical input
(float32 NHWC ``[batch, H, W, C]``, ``batch`` dynamic unless fixed) and returns class
probabilities ``[batch, classes]`` (the final softmax included; dropout is the identity at
inference and is left out).

ONNX's Conv and MaxPool are NCHW: the input is transposed once before the first of them, conv
kernels go HWIO -> OIHW, TF 'same' padding becomes explicit pads (the odd pixel after), and the
dense layer behind a flatten of NCHW activations gets its kernel rows permuted to NCHW order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model import describe, nhwc_to_nchw_rows, same_pads
from ..workload import ActivationLayer, Conv2D, Dense, Dropout, Flatten, MaxPool2D, Workload

#: Opset 17 is read by onnxruntime, OpenVINO's ONNX frontend and TVM's Relax ONNX frontend alike.
OPSET = 17
#: IR version 8 goes with opset 17; a newer IR (onnx's default) is refused by older runtimes.
IR_VERSION = 8
INPUT = "x"
OUTPUT = "probs"

_ACT = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "softmax": "Softmax"}


class _Graph:
    """Nodes and initializers, appended in order; ``value`` is the name of the current tensor."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.value = INPUT
        self.nchw = False  # layout of the current rank-4 value
        #: Set by a flatten of NCHW activations: the row order the next dense kernel needs.
        self.rows: Optional[np.ndarray] = None

    def add(self, op: str, inputs: Sequence[str], name: str, **attrs: object) -> None:
        self.nodes.append(helper.make_node(op, [self.value, *inputs], [name], name=name, **attrs))
        self.value = name

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name))
        return name

    def to_nchw(self) -> None:
        if not self.nchw:
            self.add("Transpose", [], "to_nchw", perm=[0, 3, 1, 2])
            self.nchw = True

    def activation(self, fn: str, name: str, rank: int) -> None:
        if fn == "none":
            return
        if fn == "softmax":
            # The canonical softmax is over the last NHWC axis: channels, which are axis 1 in NCHW.
            self.add("Softmax", [], name, axis=1 if rank == 4 and self.nchw else -1)
        else:
            self.add(_ACT[fn], [], name)


def build_model(workload: Workload, weights: Sequence[np.ndarray],
                batch_size: Optional[int] = None) -> onnx.ModelProto:
    """The network of ``workload`` with ``weights`` (canonical layout) as a checked ONNX model.

    ``batch_size``: None for a dynamic batch dimension, else a fixed one.
    """
    g = _Graph()
    k = 0
    for i, (layer, info) in enumerate(zip(workload.model, describe(workload))):
        if isinstance(layer, Conv2D):
            g.to_nchw()
            kernel = g.const(f"conv{i}.weight", np.transpose(weights[k], (3, 2, 0, 1)))  # HWIO -> OIHW
            bias = g.const(f"conv{i}.bias", weights[k + 1])
            k += 2
            pads = [0, 0, 0, 0]
            if layer.padding == "same":
                (top, bottom), (left, right) = (same_pads(info.in_shape[d], layer.kernel_size, layer.stride)
                                                for d in (0, 1))
                pads = [top, left, bottom, right]
            g.add("Conv", [kernel, bias], f"conv{i}", kernel_shape=[layer.kernel_size] * 2,
                  strides=[layer.stride] * 2, pads=pads)
            g.activation(layer.activation, f"conv{i}.{layer.activation}", 4)
        elif isinstance(layer, MaxPool2D):
            g.to_nchw()
            g.add("MaxPool", [], f"pool{i}", kernel_shape=[layer.pool_size] * 2,
                  strides=[layer.stride or layer.pool_size] * 2)
        elif isinstance(layer, Flatten):
            if len(info.in_shape) == 3:
                g.add("Flatten", [], f"flatten{i}", axis=1)
                if g.nchw:
                    # The canonical dense rows follow NHWC flatten order; this flattened NCHW.
                    g.rows, g.nchw = nhwc_to_nchw_rows(*info.in_shape), False
        elif isinstance(layer, Dense):
            kernel = weights[k] if g.rows is None else weights[k][g.rows]
            g.rows = None
            g.add("Gemm", [g.const(f"dense{i}.weight", kernel), g.const(f"dense{i}.bias", weights[k + 1])],
                  f"dense{i}")
            k += 2
            g.activation(layer.activation, f"dense{i}.{layer.activation}", 2)
        elif isinstance(layer, ActivationLayer):
            g.activation(layer.function, f"act{i}.{layer.function}", len(info.in_shape) + 1)
        elif not isinstance(layer, Dropout):  # dropout is the identity at inference
            raise TypeError(f"model[{i}]: no ONNX translation for {layer!r}")
    if k != len(weights):
        raise ValueError(f"the model has {k} weight arrays; got {len(weights)}")
    g.nodes[-1].output[0] = OUTPUT

    batch: int | str = batch_size if batch_size is not None else "batch"
    graph = helper.make_graph(
        g.nodes, workload.name,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, *workload.input_shape])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, workload.num_classes])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="benchbackend", ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def model_bytes(workload: Workload, weights: Sequence[np.ndarray], batch_size: Optional[int] = None) -> bytes:
    """:func:`build_model`, serialized (what ``InferenceSession`` and ``read_model`` take)."""
    return build_model(workload, weights, batch_size).SerializeToString()


def param_count(model: onnx.ModelProto) -> int:
    """Number of weights the graph carries (its float initializers)."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)

