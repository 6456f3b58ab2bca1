"""The building blocks of the spec's ONNX graph, shared by ``onnx_graph.py`` (the CNN layers, the
whole model) and ``onnx_transformer.py`` (the token layers): a value (:class:`Value`) and the node
list being built (:class:`Builder`), with the activations, GELU included (opset 17 has no Gelu:
``0.5 x (1 + Erf(x / sqrt 2))``, or the tanh form when ``approximate``) and SiLU
(``x * Sigmoid(x)``: opset 17 has no Swish).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

_ACT = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "softmax": "Softmax"}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class Value:
    """A tensor of the graph: its name, whether a rank-4 one is NCHW, and for a flat one made by
    flattening NCHW activations, the image (H, W, C) it came from (its features are in NCHW order)."""

    name: str
    nchw: bool = False
    flat_from: Optional[tuple[int, int, int]] = None


class Builder:
    """Nodes and initializers, appended in order."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._nchw: dict[str, str] = {}  # NHWC value -> its transposed twin
        self._scalars: dict[float, str] = {}
        #: graph node index of an embedding -> its table's initializer (a tied dense reads it).
        self.tables: dict[int, str] = {}

    def add(self, op: str, inputs: Sequence[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=name, **attrs))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name))
        return name

    def ints(self, name: str, values: Union[int, Sequence[int]]) -> str:
        """An int64 ``Constant`` (a shape, an index): not an initializer, so not a weight."""
        tensor = numpy_helper.from_array(np.array(values, np.int64), name)
        return self.add("Constant", [], name, value=tensor)

    def floats(self, name: str, array: np.ndarray) -> str:
        """A float32 ``Constant`` (a mask, RoPE's cos/sin tables): not an initializer, so not a weight."""
        tensor = numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name)
        return self.add("Constant", [], name, value=tensor)

    def scalar(self, value: float) -> str:
        """A float32 scalar ``Constant``, one per value in the graph."""
        if value not in self._scalars:
            name = f"scalar{len(self._scalars)}"
            self._scalars[value] = self.add("Constant", [], name, value=numpy_helper.from_array(
                np.array(value, np.float32), name))
        return self._scalars[value]

    def nchw(self, v: Value) -> str:
        """``v`` (rank 4) in NCHW: ONNX's Conv, MaxPool, BatchNormalization and pools are NCHW."""
        if v.nchw:
            return v.name
        if v.name not in self._nchw:
            self._nchw[v.name] = self.add("Transpose", [v.name], f"{v.name}.nchw", perm=[0, 3, 1, 2])
        return self._nchw[v.name]

    def activation(self, fn: str, v: Value, name: str, rank: int, approximate: bool = False) -> Value:
        if fn == "none":
            return v
        if fn == "gelu":
            return Value(self.gelu(v.name, name, approximate), v.nchw, v.flat_from)
        if fn == "silu":
            return Value(self.add("Mul", [v.name, self.add("Sigmoid", [v.name], f"{name}.sigmoid")], name), v.nchw,
                         v.flat_from)
        if fn == "softmax":
            # The canonical softmax is over the last NHWC axis: channels, which are axis 1 in NCHW.
            return Value(self.add("Softmax", [v.name], name, axis=1 if rank == 4 and v.nchw else -1), v.nchw,
                         v.flat_from)
        return Value(self.add(_ACT[fn], [v.name], name), v.nchw, v.flat_from)

    def gelu(self, x: str, name: str, approximate: bool) -> str:
        """Exact: ``0.5 x (1 + erf(x / sqrt 2))``; approximate: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
        if approximate:
            cube = self.add("Mul", [x, self.add("Mul", [x, x], f"{name}.x2")], f"{name}.x3")
            inner = self.add("Add", [x, self.add("Mul", [cube, self.scalar(0.044715)], f"{name}.c")], f"{name}.inner")
            arg = self.add("Mul", [inner, self.scalar(_SQRT_2_OVER_PI)], f"{name}.arg")
            curve = self.add("Tanh", [arg], f"{name}.tanh")
        else:
            curve = self.add("Erf", [self.add("Div", [x, self.scalar(math.sqrt(2.0))], f"{name}.arg")], f"{name}.erf")
        one_plus = self.add("Add", [curve, self.scalar(1.0)], f"{name}.1p")
        return self.add("Mul", [self.add("Mul", [x, self.scalar(0.5)], f"{name}.half"), one_plus], name)
