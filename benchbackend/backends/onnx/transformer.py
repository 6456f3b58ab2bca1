"""The transformer layers of the spec's ONNX graph (``onnx_graph.py``), in opset 17 operators.

Token sequences are ``[batch, T, d]`` (the canonical layout, ``model.py``), batch dynamic:

- ``tokens``: the conv's NCHW output reshaped to ``[batch, C, H*W]`` and transposed to
  ``[batch, H*W, C]``, which keeps the canonical row-major (h, w) token order (an NHWC input is
  reshaped straight to ``[batch, H*W, C]``);
- ``class_token``: the ``(d,)`` token Expanded to ``[batch, 1, d]`` (the batch read from the input's
  Shape) and Concatenated in front; ``position_embedding``: an Add of the ``(T, d)`` table;
- ``layernorm``: ``LayerNormalization`` over axis -1 with the spec's ``epsilon``;
- ``attention``: MatMul + Add per q/k/v projection (canonical kernels, heads-major columns), Reshape
  ``[batch, T, heads, head_dim]`` and Transpose to ``[batch, heads, T, head_dim]`` (k straight to
  ``[batch, heads, head_dim, T]``), MatMul ``q k^T``, Mul by ``1/sqrt(head_dim)``, Softmax over the
  keys, MatMul with v, Transpose and Reshape back to ``[batch, T, heads*head_dim]`` (heads in order),
  MatMul + Add of the output projection;
- ``dense`` on tokens: MatMul on the last axis + Add; ``select_token``: Gather on axis 1;
  ``global_avgpool`` over tokens: ReduceMean over axis 1;
- GELU (``onnx_nodes.Builder.gelu``, with the other activations): ``0.5 x (1 + Erf(x / sqrt 2))``
  (opset 17 has no Gelu), or the tanh form when ``approximate``.

Scalars and shapes are ``Constant`` nodes, not initializers: the initializers are the weights only
(``onnx_graph.param_count``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...spec.graph import Node
from ...spec.layers import (
    Attention,
    ClassToken,
    Dense,
    GlobalAvgPool,
    LayerNorm,
    PositionEmbedding,
    SelectToken,
    Tokens,
)
from .nodes import Builder, Value


def handles(node: Node) -> bool:
    """Whether ``node`` is translated here: a transformer layer, or a dense layer or average pool on tokens."""
    if isinstance(node.layer, (Tokens, ClassToken, PositionEmbedding, LayerNorm, Attention, SelectToken)):
        return True
    return isinstance(node.layer, (Dense, GlobalAvgPool)) and len(node.in_shape) == 2


def node(g: Builder, nd: Node, x: Value, w: Sequence[np.ndarray]) -> str:
    """The ONNX nodes of one token-layer graph node reading ``x``; the name of its output (no activation)."""
    layer, tag = nd.layer, f"n{nd.index}.{nd.kind}"
    if isinstance(layer, Tokens):
        h, wd, c = nd.in_shape
        if not x.nchw:
            return g.add("Reshape", [x.name, g.ints(f"{tag}.shape", [0, h * wd, c])], tag)
        flat = g.add("Reshape", [x.name, g.ints(f"{tag}.shape", [0, c, h * wd])], f"{tag}.flat")
        return g.add("Transpose", [flat], tag, perm=[0, 2, 1])
    if isinstance(layer, ClassToken):
        d = nd.in_shape[-1]
        batch = g.add("Shape", [x.name], f"{tag}.batch", start=0, end=1)
        shape = g.add("Concat", [batch, g.ints(f"{tag}.ones", [1, 1])], f"{tag}.shape", axis=0)
        token = g.add("Expand", [g.const(f"{tag}.token", w[0].reshape(1, 1, d)), shape], f"{tag}.tokens")
        return g.add("Concat", [token, x.name], tag, axis=1)
    if isinstance(layer, PositionEmbedding):
        return g.add("Add", [x.name, g.const(f"{tag}.table", w[0])], tag)
    if isinstance(layer, LayerNorm):
        return g.add("LayerNormalization", [x.name, g.const(f"{tag}.gamma", w[0]), g.const(f"{tag}.beta", w[1])],
                     tag, axis=-1, epsilon=layer.epsilon)
    if isinstance(layer, Attention):
        return attention(g, tag, x.name, w, layer.heads, layer.head_dim)
    if isinstance(layer, Dense):
        return dense(g, tag, x.name, w[0], w[1])
    if isinstance(layer, SelectToken):
        return g.add("Gather", [x.name, g.ints(f"{tag}.index", layer.index)], tag, axis=1)
    if isinstance(layer, GlobalAvgPool):
        return g.add("ReduceMean", [x.name], tag, axes=[1], keepdims=0)
    raise TypeError(f"{nd.label()}: no ONNX translation")


def dense(g: Builder, tag: str, x: str, kernel: np.ndarray, bias: np.ndarray) -> str:
    """``x @ kernel + bias`` on the last axis of ``x`` (any rank)."""
    product = g.add("MatMul", [x, g.const(f"{tag}.weight", kernel)], f"{tag}.matmul")
    return g.add("Add", [product, g.const(f"{tag}.bias", bias)], tag)


def attention(g: Builder, tag: str, x: str, w: Sequence[np.ndarray], heads: int, head_dim: int) -> str:
    """Multi-head self-attention of ``x`` ``[batch, T, d]`` on the canonical eight arrays (``model.py``)."""
    wq, bq, wk, bk, wv, bv, wo, bo = w
    split = g.ints(f"{tag}.split", [0, 0, heads, head_dim])  # [batch, T, heads, head_dim], heads major

    def project(name: str, kernel: Any, bias: Any, perm: list[int]) -> str:
        flat = dense(g, f"{tag}.{name}", x, kernel, bias)
        return g.add("Transpose", [g.add("Reshape", [flat, split], f"{tag}.{name}.heads")], f"{tag}.{name}.t",
                     perm=perm)

    q = project("q", wq, bq, [0, 2, 1, 3])  # [batch, heads, T, head_dim]
    k = project("k", wk, bk, [0, 2, 3, 1])  # [batch, heads, head_dim, T]: k^T
    v = project("v", wv, bv, [0, 2, 1, 3])
    scores = g.add("Mul", [g.add("MatMul", [q, k], f"{tag}.qk"), g.scalar(1.0 / math.sqrt(head_dim))],
                   f"{tag}.scaled")
    p = g.add("Softmax", [scores], f"{tag}.p", axis=-1)  # over the keys
    mixed = g.add("Transpose", [g.add("MatMul", [p, v], f"{tag}.pv")], f"{tag}.pv.t", perm=[0, 2, 1, 3])
    merged = g.add("Reshape", [mixed, g.ints(f"{tag}.merge", [0, 0, heads * head_dim])], f"{tag}.merged")
    return dense(g, f"{tag}.o", merged, wo, bo)
