"""Shapes, weights and FLOPs of the transformer layers (``layers.TOKEN_LAYERS``), for ``graph.py``.

A token sequence is one sample's (T, d): T tokens of width d. Weight shapes are the canonical ones
(documented with the attention layout in ``model.py``); FLOPs count a multiply-add as 2, as
``graph.py`` does for conv2d and dense, and the attention's count includes its two matrix
products per head (``q k^T`` and ``p v``), not the softmax.
"""
from __future__ import annotations

import math
from typing import Any

from .layers import Attention, ClassToken, Embedding, LayerNorm, PositionEmbedding, RMSNorm, SelectToken, Tokens

Shape = tuple[int, ...]


def _shape(shape: Shape) -> str:
    """``(784,)``, ``(32, 32, 3)``: as Python prints a tuple, and as every other message does."""
    return str(tuple(int(n) for n in shape))


def _sequence(label: str, shape: Shape) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"{label} needs a token sequence (T, d), got shape {_shape(shape)} "
                         "(a `tokens` layer turns an image into one)")
    return shape  # type: ignore[return-value]


def attention_flops(tokens: int, width: int, heads: int, head_dim: int, kv_heads: int | None = None) -> int:
    """Forward FLOPs of one sample's self-attention: the four projections (the key and value ones
    ``kv_heads`` heads wide) and, per query head, the ``q k^T`` scores and the ``p v`` mix (a
    multiply-add counted as 2). A causal mask does not halve the count: the T x T products are
    counted whole, as PaLM's MFU (``6N + 12 L H Q T`` per token) counts them and as a masked
    matmul computes them; rotary positions and the softmax are not counted."""
    inner, kv = heads * head_dim, (kv_heads or heads) * head_dim
    projections = 2 * tokens * width * (inner + 2 * kv) + 2 * tokens * inner * width
    return projections + 2 * 2 * heads * tokens * tokens * head_dim


def attention_weights(layer: Attention, width: int) -> tuple[tuple[Shape, ...], tuple[bool, ...]]:
    """The canonical arrays of an attention layer on tokens of ``width`` (``model.py``), and which
    are kernels: q, k, v, o kernels, each followed by its bias unless ``use_bias: false``."""
    inner, kv = layer.heads * layer.head_dim, layer.groups * layer.head_dim
    kernels = ((width, inner), (width, kv), (width, kv), (inner, width))
    shapes: list[Shape] = []
    kernel: list[bool] = []
    for k in kernels:
        shapes.append(k)
        kernel.append(True)
        if layer.use_bias:
            shapes.append((k[1],))
            kernel.append(False)
    return tuple(shapes), tuple(kernel)


def node_fields(label: str, layer: Any, shape: Shape) -> dict[str, Any]:
    """``graph.Node``'s fields for a transformer layer on one input of ``shape``: ``out_shape``, and
    ``weights``/``trainable``/``kernel``/``flops`` where it has them. Raises ``ValueError`` (one line
    naming the layer) when the input does not fit."""
    if isinstance(layer, Tokens):
        if len(shape) != 3:
            raise ValueError(f"{label} needs an image input (H, W, C), got shape {_shape(shape)}")
        return dict(out_shape=(shape[0] * shape[1], shape[2]))
    if isinstance(layer, LayerNorm):  # over the last axis, of a sequence or a flat vector
        d = shape[-1]
        return dict(out_shape=shape, weights=((d,), (d,)), trainable=(True, True), kernel=(False, False),
                    flops=2 * math.prod(shape))
    if isinstance(layer, RMSNorm):
        d = shape[-1]
        return dict(out_shape=shape, weights=((d,),), trainable=(True,), kernel=(False,), flops=2 * math.prod(shape))
    if isinstance(layer, Embedding):
        if len(shape) != 1:
            raise ValueError(f"{label} needs token ids (T,), got shape {_shape(shape)}")
        return dict(out_shape=(shape[0], layer.width), weights=((layer.vocab, layer.width),), trainable=(True,),
                    kernel=(False,))
    t, d = _sequence(label, shape)
    if isinstance(layer, ClassToken):
        return dict(out_shape=(t + 1, d), weights=((d,),), trainable=(True,), kernel=(False,))
    if isinstance(layer, PositionEmbedding):
        return dict(out_shape=shape, weights=((t, d),), trainable=(True,), kernel=(False,), flops=t * d)
    if isinstance(layer, Attention):
        weights, kernel = attention_weights(layer, d)
        return dict(out_shape=shape, weights=weights, trainable=(True,) * len(weights), kernel=kernel,
                    flops=attention_flops(t, d, layer.heads, layer.head_dim, layer.groups))
    if isinstance(layer, SelectToken):
        if layer.index >= t:
            raise ValueError(f"{label}: index {layer.index} is past the {t} tokens of its input")
        return dict(out_shape=(d,))
    raise TypeError(f"{label}: not a transformer layer: {layer!r}")


#: The standard deviation of the position embedding's and the token embedding's initial values
#: (torchvision's ViT, GPT-2 and Llama: normal, 0.02).
POSITION_STDDEV = 0.02


def initial_kind(layer: Any, j: int) -> str:
    """How weight ``j`` of a transformer layer starts: ``glorot`` (attention kernels), ``normal``
    (position and token embeddings, ``POSITION_STDDEV``), ``ones`` (layernorm's scale, rmsnorm's
    ``w``) or ``zeros`` (biases, layernorm's offset, rmsnorm's ``1 + w`` form, the class token, as
    torchvision's ViT starts it)."""
    if isinstance(layer, Attention):
        return "glorot" if attention_weights(layer, 1)[1][j] else "zeros"
    if isinstance(layer, (PositionEmbedding, Embedding)):
        return "normal"
    if isinstance(layer, LayerNorm) and j == 0:
        return "ones"
    if isinstance(layer, RMSNorm):
        return "ones" if layer.scale == "w" else "zeros"
    return "zeros"
