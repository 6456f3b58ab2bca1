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

A decoder's layers (``decoder.py``): ``embedding`` (Gather on the table), ``rmsnorm``, and the
attention's causal mask, rotary positions and grouped key/value heads; projections and dense layers
without biases are a MatMul alone; a tied dense layer is a MatMul by the Transpose of its
embedding's table initializer (the same one the Gather reads).

Scalars and shapes are ``Constant`` nodes, not initializers: the initializers are the weights only
(``onnx_graph.param_count``).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from ...spec.graph import Node
from ...spec.layers import (
    Attention,
    ClassToken,
    Dense,
    Embedding,
    GlobalAvgPool,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    SelectToken,
    Tokens,
)
from . import decoder
from .nodes import Builder, Value


def handles(node: Node) -> bool:
    """Whether ``node`` is translated here: a transformer layer, or a dense layer or average pool on tokens."""
    if isinstance(node.layer, (Tokens, ClassToken, PositionEmbedding, LayerNorm, Attention, SelectToken, Embedding,
                               RMSNorm)):
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
        return attention(g, tag, x.name, w, layer, nd.in_shape[0])
    if isinstance(layer, Embedding):
        return decoder.embedding(g, tag, x.name, w[0], nd.index)
    if isinstance(layer, RMSNorm):
        return decoder.rmsnorm(g, tag, x.name, w[0], layer.epsilon, layer.scale == "one_plus_w")
    if isinstance(layer, Dense) and nd.tied is not None:  # its weights: the bias alone, if any
        product = g.add("MatMul", [x.name, decoder.tied_kernel(g, tag, nd.tied)], f"{tag}.matmul")
        return g.add("Add", [product, g.const(f"{tag}.bias", w[0])], tag) if layer.use_bias else product
    if isinstance(layer, Dense):
        return dense(g, tag, x.name, w[0], w[1] if layer.use_bias else None)
    if isinstance(layer, SelectToken):
        return g.add("Gather", [x.name, g.ints(f"{tag}.index", layer.index)], tag, axis=1)
    if isinstance(layer, GlobalAvgPool):
        return g.add("ReduceMean", [x.name], tag, axes=[1], keepdims=0)
    raise TypeError(f"{nd.label()}: no ONNX translation")


def dense(g: Builder, tag: str, x: str, kernel: np.ndarray, bias: Optional[np.ndarray]) -> str:
    """``x @ kernel + bias`` on the last axis of ``x`` (any rank); ``x @ kernel`` without a bias."""
    product = g.add("MatMul", [x, g.const(f"{tag}.weight", kernel)], f"{tag}.matmul")
    return product if bias is None else g.add("Add", [product, g.const(f"{tag}.bias", bias)], tag)


def attention(g: Builder, tag: str, x: str, w: Sequence[np.ndarray], layer: Attention, tokens: int) -> str:
    """Multi-head self-attention of ``x`` ``[batch, T, d]`` on the canonical arrays (``model.py``: q, k,
    v, o kernels, each followed by its bias unless ``use_bias`` is false; k and v have ``kv_heads``
    heads), with the causal mask, rotary positions and grouped key/value heads the layer asks for."""
    heads, groups, head_dim = layer.heads, layer.groups, layer.head_dim
    step = 2 if layer.use_bias else 1
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = ((w[i], w[i + 1] if layer.use_bias else None)
                                              for i in range(0, 4 * step, step))
    share = heads // groups
    plain = layer.rope is None and share == 1  # the ViT's attention: k straight to k^T

    def project(name: str, kernel: Any, bias: Any, n: int, perm: list[int]) -> str:
        flat = dense(g, f"{tag}.{name}", x, kernel, bias)
        split = g.ints(f"{tag}.{name}.split", [0, 0, n, head_dim])  # [batch, T, n, head_dim], heads major
        return g.add("Transpose", [g.add("Reshape", [flat, split], f"{tag}.{name}.heads")], f"{tag}.{name}.t",
                     perm=perm)

    q = project("q", wq, bq, heads, [0, 2, 1, 3])  # [batch, heads, T, head_dim]
    k = project("k", wk, bk, groups, [0, 2, 3, 1] if plain else [0, 2, 1, 3])  # k^T if plain
    v = project("v", wv, bv, groups, [0, 2, 1, 3])
    if layer.rope is not None:
        q = decoder.rope(g, f"{tag}.q", q, tokens, head_dim, layer.rope)
        k = decoder.rope(g, f"{tag}.k", k, tokens, head_dim, layer.rope)
    if share > 1:
        k = decoder.repeat_kv(g, f"{tag}.k", k, groups, share, tokens, head_dim)
        v = decoder.repeat_kv(g, f"{tag}.v", v, groups, share, tokens, head_dim)
    if not plain:
        k = g.add("Transpose", [k], f"{tag}.kt", perm=[0, 1, 3, 2])  # [batch, heads, head_dim, T]
    scores = g.add("Mul", [g.add("MatMul", [q, k], f"{tag}.qk"), g.scalar(1.0 / math.sqrt(head_dim))],
                   f"{tag}.scaled")
    if layer.causal:
        scores = decoder.mask(g, tag, scores, tokens)
    p = g.add("Softmax", [scores], f"{tag}.p", axis=-1)  # over the keys
    mixed = g.add("Transpose", [g.add("MatMul", [p, v], f"{tag}.pv")], f"{tag}.pv.t", perm=[0, 2, 1, 3])
    merged = g.add("Reshape", [mixed, g.ints(f"{tag}.merge", [0, 0, heads * head_dim])], f"{tag}.merged")
    return dense(g, f"{tag}.o", merged, wo, bo)
