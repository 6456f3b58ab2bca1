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

Under bf16 the statistics of layernorm, the attention scores (accumulated in float32 by the
matmul itself) and their softmax are float32, cast back to the compute dtype after, as batchnorm
does (``jax_graph``); GELU is evaluated in float32 too (erf has no bf16 kernel of its own on every
platform). The tests plant each JAX default by replacing one of these functions
(``tests/test_vit_jax.py``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ...spec.layers import Attention, ClassToken, LayerNorm, PositionEmbedding, SelectToken, Tokens


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


def attention(x: jax.Array, w: Sequence[jax.Array], heads: int, head_dim: int) -> jax.Array:
    """Multi-head self-attention on the canonical eight arrays: per head ``softmax(q k^T * scale) v``
    over the keys, the heads concatenated in head order, then the output projection."""
    wq, bq, wk, bk, wv, bv, wo, bo = w
    q, k, v = (split_heads(x @ kernel + bias, heads) for kernel, bias in ((wq, bq), (wk, bk), (wv, bv)))
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * score_scale(head_dim)
    p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    mixed = jnp.einsum("nhqk,nkhd->nqhd", p, v)
    return mixed.reshape(*mixed.shape[:2], heads * mixed.shape[-1]) @ wo + bo


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
        return attention(x, w, layer.heads, layer.head_dim)
    if isinstance(layer, SelectToken):
        return x[:, layer.index]
    raise TypeError(f"not a transformer layer: {layer!r}")
