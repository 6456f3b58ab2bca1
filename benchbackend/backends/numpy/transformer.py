"""Array kernels of the transformer layers for the NumPy reference: forward and backward side by
side, on NumPy or CuPy arrays, in the canonical layouts of ``benchbackend.spec.model``.

Token sequences are (N, T, d). Forward functions return ``(output, cache)``; backward functions
take the upstream gradient and that cache, and return the input's gradient and the weights'
(in the layer's weight order). The conventions they define:

- layernorm normalizes over the last axis with the biased variance, ``epsilon`` inside the root;
- attention scales the scores by 1/sqrt(head_dim) and takes the softmax over the keys;
- GELU is ``x * Phi(x)`` with erf (exact), or the tanh form when ``approximate``.

And the decoder's (``spec/layers.py`` states them for the YAML):

- rmsnorm is ``x / sqrt(mean(x^2) + epsilon) * s``, ``s = w`` or ``1 + w``;
- a causal attention masks key j > query i (the score is -inf before the softmax: weight 0);
- grouped-query attention: query head h reads key/value head ``h // (heads // kv_heads)``;
- rotary positions turn the queries and keys after their projection, per head, at positions
  0..T-1: pairs (i, i + head_dim/2) (``half``) or (2i, 2i + 1) (``interleaved``), by the angle
  ``p * base ** (-2i / head_dim)``;
- an embedding's input is token ids (held as floats by the batches; whole numbers below 2**24);
- SiLU is ``x * sigmoid(x)``.
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
    Embedding,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    Rope,
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
    """``ops.activate`` with GELU (``gelu``, ``gelu_tanh``) and SiLU added."""
    if fn in ("gelu", GELU_TANH):
        return gelu(z, fn == GELU_TANH)
    if fn == "silu":
        return z * ops.activate(z, "sigmoid")
    return ops.activate(z, fn)


def activate_backward(g: Array, fn: str, z: Array, a: Array) -> Array:
    if fn in ("gelu", GELU_TANH):
        return gelu_backward(g, z, fn == GELU_TANH)
    if fn == "silu":
        s = ops.activate(z, "sigmoid")
        return g * (s + z * s * (1 - s))
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


def rmsnorm(x: Array, w: Array, epsilon: float, one_plus: bool) -> tuple[Array, tuple]:
    """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, ``s = 1 + w`` if ``one_plus`` else ``w``."""
    inv = 1.0 / get_array_module(x).sqrt((x * x).mean(axis=-1, keepdims=True) + epsilon)
    xhat = x * inv
    s = 1 + w if one_plus else w
    return xhat * s, (xhat, inv, s)


def rmsnorm_backward(g: Array, cache: tuple) -> tuple[Array, list[Array]]:
    xhat, inv, s = cache
    dxhat = g * s
    dx = inv * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, [(g * xhat).sum(axis=tuple(range(g.ndim - 1)))]


def rope_angles(xp: Any, tokens: int, head_dim: int, base: float, dtype: Any) -> tuple[Array, Array]:
    """(cos, sin), each (T, head_dim/2): position p, pair i turns by ``p * base ** (-2i / head_dim)``."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.outer(np.arange(tokens, dtype=np.float64), inv_freq)
    return xp.asarray(np.cos(angle), dtype), xp.asarray(np.sin(angle), dtype)


def rope(a: Array, rope_: Rope, inverse: bool = False) -> Array:
    """Queries or keys (N, heads, T, head_dim) turned by their positions; ``inverse`` turns them back
    (the rotation's transpose: what the backward pass applies to a gradient)."""
    xp = get_array_module(a)
    cos, sin = rope_angles(xp, a.shape[2], a.shape[3], rope_.base, a.dtype)
    return turn(a, cos, -sin if inverse else sin, rope_.pairing)


def turn(a: Array, cos: Array, sin: Array, pairing: str) -> Array:
    """``a`` (N, heads, T, head_dim) turned by the angles ``cos``/``sin`` (T, head_dim/2) of its
    tokens' positions: pairs (i, i + head_dim/2) (``half``) or (2i, 2i + 1) (``interleaved``)."""
    xp = get_array_module(a)
    if pairing == "half":
        half = a.shape[3] // 2
        x1, x2 = a[..., :half], a[..., half:]
        return xp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    x1, x2 = a[..., 0::2], a[..., 1::2]
    out = xp.empty_like(a)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def _projections(layer: Attention, w: Sequence[Array]) -> list[tuple[Array, Any]]:
    """[(kernel, bias or None)] of q, k, v, o from the layer's canonical arrays."""
    if layer.use_bias:
        return [(w[i], w[i + 1]) for i in range(0, 8, 2)]
    return [(w[i], None) for i in range(4)]


def _dense(x: Array, kernel: Array, bias: Any) -> Array:
    return x @ kernel if bias is None else x @ kernel + bias


def attention(x: Array, w: Sequence[Array], layer: Attention) -> tuple[Array, tuple]:
    """Multi-head self-attention of (N, T, d) on the canonical arrays (``model.py``): per query
    head ``softmax(q k^T / sqrt(head_dim)) v`` (rotary positions on q and k, the causal mask, the
    shared key/value head of a group), the heads merged, then the output projection."""
    xp = get_array_module(x)
    heads, groups, head_dim = layer.heads, layer.groups, layer.head_dim
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = _projections(layer, w)
    q, k, v = _split(_dense(x, wq, bq), heads), _split(_dense(x, wk, bk), groups), _split(_dense(x, wv, bv), groups)
    if layer.rope is not None:
        q, k = rope(q, layer.rope), rope(k, layer.rope)
    share = heads // groups
    kh, vh = (xp.repeat(a, share, axis=1) if share > 1 else a for a in (k, v))  # head h reads h // share
    scale = 1.0 / math.sqrt(head_dim)
    scores = (q @ kh.transpose(0, 1, 3, 2)) * scale  # (N, heads, T, T): queries x keys
    if layer.causal:
        t = x.shape[1]
        scores = xp.where(xp.triu(xp.ones((t, t), dtype=bool), k=1), -xp.inf, scores)
    p = ops.softmax(scores)
    mixed = _merge(p @ vh)
    return _dense(mixed, wo, bo), (x, q, kh, vh, p, mixed, w, scale, layer)


def attention_backward(g: Array, cache: tuple) -> tuple[Array, list[Array]]:
    """The four projections are dense layers on the tokens: ``ops.dense_backward`` takes them; a
    group's key/value gradients are summed over the query heads that share them."""
    x, q, kh, vh, p, mixed, w, scale, layer = cache
    (wq, _), (wk, _), (wv, _), (wo, _) = _projections(layer, w)
    heads, groups = layer.heads, layer.groups
    g_mixed, d_wo, d_bo = ops.dense_backward(g, (mixed, wo))
    d_mixed = _split(g_mixed, heads)
    d_p = d_mixed @ vh.transpose(0, 1, 3, 2)
    d_v = p.transpose(0, 1, 3, 2) @ d_mixed
    d_s = p * (d_p - (d_p * p).sum(axis=-1, keepdims=True)) * scale  # softmax, then the scaling
    d_q, d_k = d_s @ kh, d_s.transpose(0, 1, 3, 2) @ q  # a masked score has p = 0: no gradient
    if heads != groups:
        n, _, t, dh = d_k.shape
        d_k, d_v = (a.reshape(n, groups, heads // groups, t, dh).sum(axis=2) for a in (d_k, d_v))
    if layer.rope is not None:
        d_q, d_k = rope(d_q, layer.rope, inverse=True), rope(d_k, layer.rope, inverse=True)
    dx, grads = 0, []
    for d_out, kernel in ((d_q, wq), (d_k, wk), (d_v, wv)):
        g_x, d_kernel, d_bias = ops.dense_backward(_merge(d_out), (x, kernel))
        dx = dx + g_x
        grads += [d_kernel, d_bias] if layer.use_bias else [d_kernel]
    return dx, grads + ([d_wo, d_bo] if layer.use_bias else [d_wo])


def embedding(ids: Array, table: Array) -> tuple[Array, tuple]:
    """Rows of ``table`` (vocab, width) for token ids (N, T)."""
    index = ids.astype(np.int64)
    return table[index], (index, table.shape)


def embedding_backward(g: Array, cache: tuple) -> list[Array]:
    """The table's gradient: each id's row gets the sum of its positions' gradients."""
    index, shape = cache
    xp = get_array_module(g)
    d_table = xp.zeros(shape, g.dtype)
    if xp is np:
        np.add.at(d_table, index.reshape(-1), g.reshape(-1, shape[1]))
    else:
        import cupyx

        cupyx.scatter_add(d_table, index.reshape(-1), g.reshape(-1, shape[1]))
    return [d_table]


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
    if isinstance(layer, PositionEmbedding):  # token t gets row t (a prefix of the context: generation)
        return x + w[0][:x.shape[1]], None
    if isinstance(layer, LayerNorm):
        return layernorm(x, w[0], w[1], layer.epsilon)
    if isinstance(layer, Attention):
        return attention(x, w, layer)
    if isinstance(layer, RMSNorm):
        return rmsnorm(x, w[0], layer.epsilon, layer.scale == "one_plus_w")
    if isinstance(layer, Embedding):
        return embedding(x, w[0])
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
    if isinstance(layer, Embedding):
        return [None], embedding_backward(g, cache)  # token ids have no gradient
    if isinstance(layer, RMSNorm):
        dx, grads = rmsnorm_backward(g, cache)
        return [dx], grads
    dx, grads = (layernorm_backward if isinstance(layer, LayerNorm) else attention_backward)(g, cache)
    return [dx], grads
