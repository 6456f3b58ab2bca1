"""The decoder's pieces of the spec's ONNX graph (``transformer.py`` places them), in opset 17
operators, with the conventions of the NumPy reference (``numpy/transformer.py``):

- ``embedding``: ``Gather`` on axis 0 of the ``(vocab, width)`` table initializer, the float token
  ids ``Cast`` to int64; the table's initializer name is recorded (``Builder.tables``), so that a
  tied dense layer reads the SAME initializer (``Transpose`` then ``MatMul``), not a copy;
- ``rmsnorm``: opset 17 has no RMSNormalization: ``x / Sqrt(ReduceMean(x * x) + epsilon)`` over the
  last axis, times ``w`` (``scale: w``) or ``1 + w`` (``one_plus_w``: an ``Add`` of 1 in the graph,
  so the initializer stays the canonical ``w``);
- rotary positions (``rope``) on queries or keys ``[batch, heads, T, head_dim]``, positions 0..T-1:
  ``a * C + Gather(a, partner) * S``, where ``partner`` is each dimension's pair (``half``: i with
  i + head_dim/2; ``interleaved``: 2i with 2i + 1), ``C`` the pair's cosine and ``S`` its sine,
  negated on the pair's first dimension (``(a cos - b sin, a sin + b cos)``), precomputed
  ``(T, head_dim)`` constants at angle ``p * base ** (-2i / head_dim)``;
- the causal mask: an additive ``(T, T)`` constant, 0 where key j <= query i and -1e9 above the
  diagonal (``exp`` of it is exactly 0 in float32: a masked key has weight 0);
- grouped key/value heads (``kv_heads``), blocked: query head h reads key/value head
  h // (heads // kv_heads): ``[batch, kv_heads, T, head_dim]`` gets an axis after the heads,
  ``Expand`` repeats each head ``share`` times consecutively, and a ``Reshape`` makes
  ``[batch, heads, T, head_dim]``.

The constants are ``Constant`` nodes, not initializers: the initializers are the weights only.
"""
from __future__ import annotations

import numpy as np

from ...spec.layers import Rope
from .nodes import Builder

#: The additive mask of a key a query must not see: exp(-1e9 - max) is 0 in float32 (and bf16).
MASKED = -1e9


def embedding(g: Builder, tag: str, ids: str, table: np.ndarray, index: int) -> str:
    """Rows of ``table`` for the float ids ``[batch, T]``; ``index``: the graph node, for a tied dense."""
    name = g.const(f"{tag}.table", table)
    g.tables[index] = name
    return g.add("Gather", [name, g.add("Cast", [ids], f"{tag}.ids", to=7)], tag, axis=0)  # 7: INT64


def tied_kernel(g: Builder, tag: str, index: int) -> str:
    """The transposed table ``(width, vocab)`` of graph node ``index``'s embedding, its one initializer."""
    return g.add("Transpose", [g.tables[index]], f"{tag}.kernel", perm=[1, 0])


def rmsnorm(g: Builder, tag: str, x: str, w: np.ndarray, epsilon: float, one_plus: bool) -> str:
    """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, ``s = 1 + w`` if ``one_plus`` else ``w``."""
    square = g.add("ReduceMean", [g.add("Mul", [x, x], f"{tag}.x2")], f"{tag}.ms", axes=[-1], keepdims=1)
    root = g.add("Sqrt", [g.add("Add", [square, g.scalar(epsilon)], f"{tag}.mse")], f"{tag}.rms")
    xhat = g.add("Div", [x, root], f"{tag}.xhat")
    scale = g.const(f"{tag}.weight", w)
    if one_plus:
        scale = g.add("Add", [scale, g.scalar(1.0)], f"{tag}.scale")
    return g.add("Mul", [xhat, scale], tag)


def rope_tables(tokens: int, head_dim: int, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C, S, partner): ``(T, head_dim)`` cosines and signed sines of each dimension's pair, and the
    index of each dimension's partner in its pair."""
    half = head_dim // 2
    inv_freq = rope.base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.outer(np.arange(tokens, dtype=np.float64), inv_freq)  # (T, head_dim/2): pair i
    cos, sin = np.cos(angle), np.sin(angle)
    if rope.pairing == "half":  # pair i is (i, i + half)
        c, s = np.concatenate([cos, cos], axis=1), np.concatenate([-sin, sin], axis=1)
        partner = np.concatenate([np.arange(half, head_dim), np.arange(half)])
    else:  # interleaved: pair i is (2i, 2i + 1)
        c = np.repeat(cos, 2, axis=1)
        s = np.stack([-sin, sin], axis=2).reshape(tokens, head_dim)
        partner = np.arange(head_dim) ^ 1
    return c, s, partner


def rope(g: Builder, tag: str, a: str, tokens: int, head_dim: int, rope_: Rope) -> str:
    """Queries or keys ``[batch, heads, T, head_dim]`` turned by their positions 0..T-1."""
    c, s, partner = rope_tables(tokens, head_dim, rope_)
    swapped = g.add("Gather", [a, g.ints(f"{tag}.partner", partner.tolist())], f"{tag}.partner.x", axis=-1)
    cos = g.add("Mul", [a, g.floats(f"{tag}.cos", c)], f"{tag}.cos.x")
    sin = g.add("Mul", [swapped, g.floats(f"{tag}.sin", s)], f"{tag}.sin.x")
    return g.add("Add", [cos, sin], f"{tag}.rope")


def causal_mask(tokens: int) -> np.ndarray:
    """``(T, T)``: 0 where key j <= query i (token t sees 0..t), ``MASKED`` above the diagonal."""
    return np.triu(np.full((tokens, tokens), MASKED, np.float32), k=1)


def mask(g: Builder, tag: str, scores: str, tokens: int) -> str:
    """The causal mask added to the scores ``[batch, heads, T, T]`` (queries x keys)."""
    return g.add("Add", [scores, g.floats(f"{tag}.mask", causal_mask(tokens))], f"{tag}.masked")


def repeat_kv(g: Builder, tag: str, a: str, groups: int, share: int, tokens: int, head_dim: int) -> str:
    """``[batch, groups, T, head_dim]`` -> ``[batch, groups * share, T, head_dim]``, each key/value head
    repeated ``share`` times consecutively (blocked: head h reads h // share)."""
    wide = g.add("Unsqueeze", [a, g.ints(f"{tag}.axis", [2])], f"{tag}.wide")  # [batch, groups, 1, T, hd]
    shared = g.add("Expand", [wide, g.ints(f"{tag}.share", [1, 1, share, 1, 1])], f"{tag}.shared")
    return g.add("Reshape", [shared, g.ints(f"{tag}.repeat", [0, groups * share, tokens, head_dim])],
                 f"{tag}.repeated")
