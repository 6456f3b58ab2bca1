"""Array kernels of the transformer layers for the NumPy reference: forward and backward side by
side, on NumPy or CuPy arrays, in the canonical layouts of ``benchbackend.spec.model``.

Token sequences are (N, T, d). Forward functions return ``(output, cache)``; backward functions
take the upstream gradient and that cache, and return the input's gradient and the weights'
(in the layer's weight order). The conventions they define:

- layernorm normalizes over the last axis with the biased variance, ``epsilon`` inside the root;
- attention scales the scores by 1/sqrt(head_dim) and takes the softmax over the keys;
- GELU is ``x * Phi(x)`` with erf (exact), or the tanh form when ``approximate``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...spec.layers import (
    GELU_TANH,
    ActivationLayer,
    Attention,
    ClassToken,
    LayerNorm,
    PositionEmbedding,
    SelectToken,
    Tokens,
)
from . import ops
from .ops import Array, get_array_module

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --- GELU ------------------------------------------------------------------------------------
def _erf(z: Array) -> Array:
    if get_array_module(z) is np:
        from scipy.special import erf  # a core dependency; NumPy has no erf
    else:
        from cupyx.scipy.special import erf
    return erf(z)


def gelu(z: Array, approximate: bool = False) -> Array:
    """Exact: ``0.5 z (1 + erf(z / sqrt 2))``; approximate: ``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``."""
    xp = get_array_module(z)
    if approximate:
        return 0.5 * z * (1 + xp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3)))
    return 0.5 * z * (1 + _erf(z / math.sqrt(2.0)))


def gelu_backward(g: Array, z: Array, approximate: bool = False) -> Array:
    xp = get_array_module(z)
    if approximate:
        t = xp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
        dt = (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
        return g * (0.5 * (1 + t) + 0.5 * z * dt)
    cdf = 0.5 * (1 + _erf(z / math.sqrt(2.0)))
    pdf = xp.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return g * (cdf + z * pdf)


def activate(z: Array, fn: str) -> Array:
    """``ops.activate`` with GELU (``gelu``, ``gelu_tanh``) added."""
    if fn in ("gelu", GELU_TANH):
        return gelu(z, fn == GELU_TANH)
    return ops.activate(z, fn)


def activate_backward(g: Array, fn: str, z: Array, a: Array) -> Array:
    if fn in ("gelu", GELU_TANH):
        return gelu_backward(g, z, fn == GELU_TANH)
    return ops.activate_backward(g, fn, z, a)


# --- layers ----------------------------------------------------------------------------------
def layernorm(x: Array, gamma: Array, beta: Array, epsilon: float) -> tuple[Array, tuple]:
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` over the last axis (biased variance)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    inv = 1.0 / get_array_module(x).sqrt(var + epsilon)
    xhat = (x - mean) * inv
    return xhat * gamma + beta, (xhat, inv, gamma)


def layernorm_backward(g: Array, cache: tuple) -> tuple[Array, list[Array]]:
    xhat, inv, gamma = cache
    axes = tuple(range(g.ndim - 1))
    dxhat = g * gamma
    dx = inv * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, [(g * xhat).sum(axis=axes), g.sum(axis=axes)]


def _split(a: Array, heads: int) -> Array:
    """(N, T, heads * head_dim) -> (N, heads, T, head_dim): column i * head_dim + j is head i's j."""
    n, t, inner = a.shape
    return a.reshape(n, t, heads, inner // heads).transpose(0, 2, 1, 3)


def _merge(a: Array) -> Array:
    """Inverse of ``_split``: the heads concatenated in head order."""
    n, h, t, dh = a.shape
    return a.transpose(0, 2, 1, 3).reshape(n, t, h * dh)


def attention(x: Array, w: Sequence[Array], heads: int, head_dim: int) -> tuple[Array, tuple]:
    """Multi-head self-attention of (N, T, d) on the canonical eight arrays (``model.py``):
    per head ``softmax(q k^T / sqrt(head_dim)) v``, the heads merged, then the output projection."""
    wq, bq, wk, bk, wv, bv, wo, bo = w
    q, k, v = (_split(x @ kw + kb, heads) for kw, kb in ((wq, bq), (wk, bk), (wv, bv)))
    scale = 1.0 / math.sqrt(head_dim)
    p = ops.softmax((q @ k.transpose(0, 1, 3, 2)) * scale)  # (N, heads, T, T): queries x keys
    mixed = _merge(p @ v)
    return mixed @ wo + bo, (x, q, k, v, p, mixed, w, scale)


def attention_backward(g: Array, cache: tuple) -> tuple[Array, list[Array]]:
    """The four projections are dense layers on the tokens: ``ops.dense_backward`` takes them."""
    x, q, k, v, p, mixed, w, scale = cache
    wq, _, wk, _, wv, _, wo, _ = w
    heads = q.shape[1]
    g_mixed, d_wo, d_bo = ops.dense_backward(g, (mixed, wo))
    d_mixed = _split(g_mixed, heads)
    d_p = d_mixed @ v.transpose(0, 1, 3, 2)
    d_v = p.transpose(0, 1, 3, 2) @ d_mixed
    d_s = p * (d_p - (d_p * p).sum(axis=-1, keepdims=True)) * scale  # softmax, then the scaling
    d_q, d_k = d_s @ k, d_s.transpose(0, 1, 3, 2) @ q
    dx, grads = 0, []
    for d_out, kernel in ((d_q, wq), (d_k, wk), (d_v, wv)):
        g_x, d_kernel, d_bias = ops.dense_backward(_merge(d_out), (x, kernel))
        dx = dx + g_x
        grads += [d_kernel, d_bias]
    return dx, grads + [d_wo, d_bo]


# --- the graph's view: one forward and one backward per layer ----------------------------------
def forward(layer: Any, x: Array, w: Sequence[Array]) -> tuple[Array, Any]:
    """``layer`` (one of ``layers.TOKEN_LAYERS``) on ``x`` with its weights ``w``."""
    xp = get_array_module(x)
    if isinstance(layer, Tokens):
        n, h, wd, c = x.shape
        return x.reshape(n, h * wd, c), x.shape
    if isinstance(layer, ClassToken):
        n, _, d = x.shape
        return xp.concatenate([xp.broadcast_to(w[0].reshape(1, 1, d), (n, 1, d)), x], axis=1), None
    if isinstance(layer, PositionEmbedding):
        return x + w[0], None
    if isinstance(layer, LayerNorm):
        return layernorm(x, w[0], w[1], layer.epsilon)
    if isinstance(layer, Attention):
        return attention(x, w, layer.heads, layer.head_dim)
    if isinstance(layer, SelectToken):
        return x[:, layer.index], (x.shape, layer.index)
    raise TypeError(f"not a transformer layer: {layer!r}")


def backward(layer: Any, g: Array, cache: Any) -> tuple[list[Array], list[Array]]:
    """([the input's gradient], the weights' gradients) of ``forward``, as ``Network`` takes them;
    an ``activation`` layer passes the gradient through (the graph walk applies its function)."""
    if isinstance(layer, ActivationLayer):
        return [g], []
    if isinstance(layer, Tokens):
        return [g.reshape(cache)], []
    if isinstance(layer, ClassToken):
        return [g[:, 1:]], [g[:, 0].sum(axis=0)]
    if isinstance(layer, PositionEmbedding):
        return [g], [g.sum(axis=0)]
    if isinstance(layer, SelectToken):
        shape, index = cache
        dx = get_array_module(g).zeros(shape, g.dtype)
        dx[:, index] = g
        return [dx], []
    dx, grads = (layernorm_backward if isinstance(layer, LayerNorm) else attention_backward)(g, cache)
    return [dx], grads
