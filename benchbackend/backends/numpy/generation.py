"""Greedy generation with a key/value cache on the reference's arrays (the ``numpy`` backend, NumPy
or CuPy): the graph run over the new tokens only, each attention layer reading and extending its cache.

This is the cached path, not the definition: ``run/truth.py``'s ``greedy`` recomputes the whole sequence
for every token and is what every backend's tokens are held to, this path included. The cache's
conventions, which every adapter's cache follows:

- one static cache per attention layer, keys and values each (B, kv_heads, positions, head_dim),
  in the spec's ``generation.cache`` dtype (float32 by default, whatever the compute dtype);
- the new tokens at positions ``start .. start + T - 1``: rotary angles and learned position
  embedding rows of those positions (not 0..T-1), their keys and values written at those
  positions, and query ``start + i`` attends to keys ``0 .. start + i`` (the causal mask, offset);
- only the last position's output is computed by the output layer (its argmax is the next token);
  the softmax is skipped (argmax of the logits is argmax of the probabilities).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...spec.graph import INPUT
from ...spec.layers import Attention, PositionEmbedding, activation_name
from . import ops
from . import transformer as tr

Array = ops.Array


def _rope_at(a: Array, rope_: Any, start: int) -> Array:
    """``tr.rope`` at positions ``start .. start + T - 1``."""
    xp = ops.get_array_module(a)
    cos, sin = tr.rope_angles(xp, start + a.shape[2], a.shape[3], rope_.base, a.dtype)
    return tr.turn(a, cos[start:], sin[start:], rope_.pairing)


def attention(x: Array, w: list[Array], layer: Attention, cache: tuple[Array, Array], start: int) -> Array:
    """``tr.attention`` on the new tokens ``x`` (B, T, d) at positions ``start ..``: their keys and
    values go into ``cache`` there, and the queries attend to every cached position up to their own."""
    xp = ops.get_array_module(x)
    keys, values = cache
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = tr._projections(layer, w)
    q = tr._split(tr._dense(x, wq, bq), layer.heads)
    k, v = tr._split(tr._dense(x, wk, bk), layer.groups), tr._split(tr._dense(x, wv, bv), layer.groups)
    if layer.rope is not None:
        q, k = _rope_at(q, layer.rope, start), _rope_at(k, layer.rope, start)
    t = x.shape[1]
    end = start + t
    keys[:, :, start:end], values[:, :, start:end] = k, v  # cast to the cache's dtype
    share = layer.heads // layer.groups
    kh, vh = (xp.repeat(a[:, :, :end].astype(x.dtype), share, axis=1) for a in (keys, values))
    scores = (q @ kh.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(layer.head_dim))  # (B, heads, T, end)
    if layer.causal:  # query start + i sees keys 0 .. start + i
        later = xp.arange(end)[None, :] > (start + xp.arange(t))[:, None]
        scores = xp.where(later, -xp.inf, scores)
    return tr._dense(tr._merge(ops.softmax(scores) @ vh), wo, bo)


class Generator:
    """The cached forward of a ``reference.Network`` (its graph and weights, as they are)."""

    def __init__(self, net: Any, dtype: Any):
        self.net, self.graph = net, net.graph
        self.dtype = dtype
        self.caches: dict[int, tuple[Array, Array]] = {}

    def start(self, xp: Any, batch: int, positions: int, cache_dtype: Any) -> None:
        self.caches = {node.index: tuple(xp.zeros((batch, node.layer.groups, positions, node.layer.head_dim),
                                                  cache_dtype) for _ in range(2))
                       for node in self.graph.nodes if isinstance(node.layer, Attention)}

    def nbytes(self) -> tuple[int, int]:
        arrays = [a for pair in self.caches.values() for a in pair]
        return int(sum(a.nbytes for a in arrays)), int(arrays[0].shape[2]) if arrays else 0

    def next_ids(self, ids: Array, start: int) -> Array:
        """The greedy next token (B,) after the tokens ``ids`` (B, T) at positions ``start ..``."""
        g, net = self.graph, self.net
        values: list[Array] = []
        for node in g.nodes:
            ins = [ids.astype(self.dtype) if j == INPUT else values[j] for j in node.inputs]
            w = g.weights_of(node, net.weights)
            if node.tied is not None:
                w = [g.weights_of(g.nodes[node.tied], net.weights)[0].T] + w
            if node is g.output:  # the last position only
                ins = [a[:, -1:] for a in ins]
            layer = node.layer
            if isinstance(layer, Attention):
                out = attention(ins[0], w, layer, self.caches[node.index], start)
            elif isinstance(layer, PositionEmbedding):
                out = ins[0] + w[0][start:start + ins[0].shape[1]]
            else:
                out, _ = net._layer(node, ins, w, None, False, False)
            fn = activation_name(layer, node.activation)
            values.append(out if node is g.output else tr.activate(out, fn))
        return values[-1][:, -1].argmax(axis=-1).astype(np.int32)


class Generates:
    """The ``numpy`` backend's generation methods (``Backend``'s contract) on a :class:`Generator` of
    its network; mixed into ``NumpyBackend``."""

    generation_note = ""

    def start_generation(self, batch: int, positions: int) -> None:
        from ...errors import BackendUnavailable

        self.generator = Generator(self._net(), self.dtype)
        cache = {"fp32": np.float32, "bf16": None, "fp16": np.float16}[self.workload.generating.cache]
        if cache is None:
            raise BackendUnavailable("numpy: NumPy has no bfloat16 for a bf16 key/value cache")
        self.generator.start(self.xp, batch, positions, cache)

    def prefill(self, ids: np.ndarray) -> Array:
        return self.generator.next_ids(self.xp.asarray(ids), 0)

    def decode(self, ids: Array, position: int) -> Array:
        return self.generator.next_ids(ids[:, None], position)

    def cache_bytes(self) -> tuple[int, int]:
        return self.generator.nbytes()
