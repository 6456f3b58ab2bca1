"""The transformer layers in ``jax.lax``/``jax.numpy`` on the canonical weights as they are (``model.py``).

Token sequences are (N, T, d), batch first. The conventions, each written out where a JAX default
(flax's or ``jax.nn``'s) would differ from the reference's:

- GELU is ``jax.nn.gelu(x, approximate=False)`` (erf) unless the layer says ``approximate: true``:
  ``jax.nn.gelu``'s own default is the tanh form;
- layernorm takes the layer's ``epsilon`` (flax's 1e-6 equals the spec's default only by chance)
  and the biased variance, over the last axis;
- attention reads the q/k/v columns heads-major, ``(heads * head_dim)`` -> ``(heads, head_dim)``
  (``split_heads``), and scales the scores by 1/sqrt(head_dim) (``score_scale``), whatever the
  width d: ``heads * head_dim`` need not equal it.

The decoder's conventions (``spec/layers.py``), each one function so a test can plant its wrong twin:

- ``rmsnorm``: ``x / sqrt(mean(x^2) + epsilon) * s``, ``s = w`` or ``1 + w`` (the layer's ``scale``);
- ``causal_mask``: query t sees keys 0..t (``jnp.where`` puts -inf on the rest before the softmax);
- ``repeat_kv``: grouped key/value heads in blocks, query head h reads kv head ``h // (heads // kv_heads)``
  (``jnp.repeat`` on the head axis: Hugging Face's ``repeat_kv``; ``jnp.tile`` would interleave them);
- ``rope``: rotary positions 0..T-1 on q and k after their projection, pairs ``half`` (i, i + dh/2)
  or ``interleaved`` (2i, 2i + 1), angle ``p * base ** (-2i / dh)``;
- ``embedding``: the float ids cast to int32, then ``jnp.take`` (whose gradient sums over repeated ids).

Under bf16 the statistics of layernorm and rmsnorm, the attention scores (accumulated in float32
by the matmul itself) and their softmax (``softmax``) are float32, cast back to the compute dtype
after, as batchnorm does (``jax_graph``); GELU and the rotary turn are evaluated in float32 too
(erf has no bf16 kernel of its own on every platform). The tests plant each JAX default by
replacing one of these functions (``tests/test_vit_jax.py``, ``tests/test_decoder_jax.py``).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...spec.layers import (
    Attention,
    ClassToken,
    Embedding,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    SelectToken,
    Tokens,
)


def gelu(x: jax.Array, approximate: bool) -> jax.Array:
    """GELU with its form always passed: ``jax.nn.gelu`` alone would be the tanh one."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=approximate).astype(x.dtype)


def layernorm(x: jax.Array, gamma: jax.Array, beta: jax.Array, epsilon: float) -> jax.Array:
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` over the last axis, biased variance, in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    out = (x32 - mean) * lax.rsqrt(var + epsilon) * gamma.astype(jnp.float32) + beta.astype(jnp.float32)
    return out.astype(x.dtype)


def split_heads(a: jax.Array, heads: int) -> jax.Array:
    """(N, T, heads * head_dim) -> (N, T, heads, head_dim): column ``i * head_dim + j`` is head i's j."""
    return a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads)


def score_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def rmsnorm(x: jax.Array, w: jax.Array, epsilon: float, one_plus: bool) -> jax.Array:
    """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, ``s = 1 + w`` if ``one_plus`` else
    ``w``; the statistics in float32."""
    x32 = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
    s = w.astype(jnp.float32)
    return (x32 * inv * (1.0 + s if one_plus else s)).astype(x.dtype)


def embedding(ids: jax.Array, table: jax.Array) -> jax.Array:
    """Rows of ``table`` (vocab, width) for token ids (N, T) held as floats (whole numbers)."""
    return jnp.take(table, ids.astype(jnp.int32), axis=0)


def causal_mask(tokens: int) -> jax.Array:
    """(T, T) booleans, True where query i may read key j: j <= i (itself included)."""
    return jnp.tril(jnp.ones((tokens, tokens), dtype=bool))


def repeat_kv(a: jax.Array, share: int) -> jax.Array:
    """Keys or values (N, T, kv_heads, head_dim) -> (N, T, kv_heads * share, head_dim): query head h
    reads key/value head ``h // share`` (blocks of ``share`` consecutive query heads)."""
    return jnp.repeat(a, share, axis=2) if share > 1 else a


def rope_angles(tokens: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each (T, head_dim/2) float32: position p, pair i turns by ``p * base ** (-2i / head_dim)``
    (computed in float64 on the host: constants of the compiled step)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.outer(np.arange(tokens, dtype=np.float64), inv_freq)
    return jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)


def rope(a: jax.Array, base: float, pairing: str) -> jax.Array:
    """Queries or keys (N, T, heads, head_dim) turned by their positions 0..T-1, in float32."""
    t, dh = a.shape[1], a.shape[-1]
    cos, sin = (c[:, None, :] for c in rope_angles(t, dh, base))  # (T, 1, dh/2): every head alike
    return turn(a, cos, sin, pairing)


def turn(a: jax.Array, cos: jax.Array, sin: jax.Array, pairing: str) -> jax.Array:
    """``a`` (N, T, heads, head_dim) turned in float32 by the angles ``cos``/``sin`` (T, 1, dh/2) of
    its tokens' positions: pairs (i, i + dh/2) (``half``) or (2i, 2i + 1) (``interleaved``)."""
    dh = a.shape[-1]
    a32 = a.astype(jnp.float32)
    if pairing == "half":
        x1, x2 = a32[..., :dh // 2], a32[..., dh // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    else:
        x1, x2 = a32[..., 0::2], a32[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(a.shape)
    return out.astype(a.dtype)


def softmax(scores: jax.Array) -> jax.Array:
    """The attention weights: softmax over the keys, in float32 (the scores already are)."""
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1)


def _project(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array]) -> jax.Array:
    return x @ kernel if bias is None else x @ kernel + bias


def attention(x: jax.Array, w: Sequence[jax.Array], layer: Attention) -> jax.Array:
    """Multi-head self-attention on the canonical arrays (q, k, v, o kernels, each followed by its
    bias unless ``use_bias: false``): per query head ``softmax(q k^T * scale) v`` over the keys
    (rotary positions on q and k, the causal mask, the key/value head of its group), the heads
    concatenated in head order, then the output projection."""
    heads, groups = layer.heads, layer.groups
    pairs = [(w[i], w[i + 1]) for i in range(0, 8, 2)] if layer.use_bias else [(w[i], None) for i in range(4)]
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = pairs
    q = split_heads(_project(x, wq, bq), heads)
    k, v = split_heads(_project(x, wk, bk), groups), split_heads(_project(x, wv, bv), groups)
    if layer.rope is not None:
        q, k = rope(q, layer.rope.base, layer.rope.pairing), rope(k, layer.rope.base, layer.rope.pairing)
    k, v = repeat_kv(k, heads // groups), repeat_kv(v, heads // groups)
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * score_scale(layer.head_dim)
    if layer.causal:
        scores = jnp.where(causal_mask(x.shape[1]), scores, -jnp.inf)
    p = softmax(scores).astype(x.dtype)
    mixed = jnp.einsum("nhqk,nkhd->nqhd", p, v)
    return _project(mixed.reshape(*mixed.shape[:2], heads * mixed.shape[-1]), wo, bo)


def apply(layer: Any, x: jax.Array, w: list) -> jax.Array:
    """``layer`` (one of ``layers.TOKEN_LAYERS``) on ``x`` with its weights ``w``."""
    if isinstance(layer, Tokens):
        n, h, wd, c = x.shape  # NHWC, row-major over (h, w): the canonical token order
        return x.reshape(n, h * wd, c)
    if isinstance(layer, ClassToken):
        n, _, d = x.shape
        return jnp.concatenate([jnp.broadcast_to(w[0].reshape(1, 1, d), (n, 1, d)).astype(x.dtype), x], axis=1)
    if isinstance(layer, PositionEmbedding):
        return x + w[0]
    if isinstance(layer, LayerNorm):
        return layernorm(x, w[0], w[1], layer.epsilon)
    if isinstance(layer, Attention):
        return attention(x, w, layer)
    if isinstance(layer, RMSNorm):
        return rmsnorm(x, w[0], layer.epsilon, layer.scale == "one_plus_w")
    if isinstance(layer, Embedding):
        return embedding(x, w[0])
    if isinstance(layer, SelectToken):
        return x[:, layer.index]
    raise TypeError(f"not a transformer layer: {layer!r}")
