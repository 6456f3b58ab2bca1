"""Greedy generation with a key/value cache in JAX (issue 38): the cached forward pass.

The network is the adapter's own graph walk (``jax_graph``): every token-wise layer (embedding,
norms, dense, add, multiply, activations) goes through ``jax_graph._apply`` on (B, T, d) as in
training, and only the two layers that see a token's position change:

- ``attention`` (``attend``): the new tokens' keys and values are written into the layer's cache
  with ``lax.dynamic_update_slice`` at ``offset`` (their first position), rotary angles of
  positions ``offset..offset+T-1`` (``rope_at``: rows of ``jax_transformer.rope_angles``'s table);
  the prefill attends causally over its own P keys (``jax_transformer.causal_mask``), a decode step
  over the whole cache with the keys beyond its position masked;
- ``position_embedding``: rows ``offset..offset+T-1`` of the table.

The cache of each attention layer is two arrays (B, kv_heads, positions, head_dim), heads-major as
Hugging Face's, in ``workload.generating.cache`` (fp32 unless the spec says otherwise, at every
precision); a query head h reads key/value head ``h // (heads // kv_heads)`` (``repeat_kv``'s
blocks), computed by grouping the query heads (B, kv_heads, share, ...) against the cache as it is,
with no repeated copy of it. The layers after the last attention (the last block's MLP, the final
norm and the output layer) run at the last position only: greedy decoding reads nothing else.

Compilation: the prefill is one jitted function per prompt shape; the decode step one jitted
function whose position is a traced int32 scalar, so it compiles once for every position; mode
``scan`` runs ``steps`` decode steps in one ``lax.scan`` (one dispatch), rolled even on a CPU,
unlike the training block (``JaxBackend.unroll``): a decode step is small, and on gpt-nano (B=1,
P=64, G=32, XLA:CPU) the rolled loop ran at 0.07 ms/token, as fast as unrolled by 4 or 31, which
took 2 s and 9 s more to compile (the jitted step one dispatch per token: 0.17). Each takes the cache
donated and returns it updated. bf16 follows the adapter's forward: the parameters cast to
bfloat16 (once, in ``Generator``: they do not change during a generation), token ids cast to int32
by the embedding, the output read in float32 (its argmax; the softmax is skipped).
"""
from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import BackendUnavailable
from ...spec.graph import INPUT, Graph, resolve
from ...spec.layers import (
    Attention,
    ClassToken,
    Flatten,
    GlobalAvgPool,
    PositionEmbedding,
    SelectToken,
    Tokens,
    activation_name,
)
from ...spec.workload import Workload
from . import graph as jax_graph
from . import transformer as jax_transformer

CACHE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
Cache = list[tuple[jax.Array, jax.Array]]  # per attention layer, in graph order: (keys, values)


def rope_at(a: jax.Array, offset: Any, positions: int, base: float, pairing: str) -> jax.Array:
    """``jax_transformer.rope`` for tokens at positions ``offset..offset+T-1`` (``offset`` may be
    traced): queries or keys (N, T, heads, head_dim), turned in float32 by the rows of the angle
    table of all ``positions`` cache positions."""
    t, dh = a.shape[1], a.shape[-1]
    cos, sin = (lax.dynamic_slice_in_dim(c, offset, t)[:, None, :]
                for c in jax_transformer.rope_angles(positions, dh, base))
    return jax_transformer.turn(a, cos, sin, pairing)


def visible(offset: Any, tokens: int, keys: int) -> jax.Array:
    """(tokens, keys) booleans: the query at position ``offset + i`` reads cache key j <= that position."""
    return jnp.arange(keys)[None, :] <= offset + jnp.arange(tokens)[:, None]


def write(cache: jax.Array, a: jax.Array, offset: Any) -> jax.Array:
    """``cache`` (N, kv_heads, positions, head_dim) with ``a`` (N, kv_heads, T, head_dim) at positions
    ``offset..offset+T-1``."""
    return lax.dynamic_update_slice(cache, a, (0, 0, offset, 0))


def position_rows(table: jax.Array, offset: Any, tokens: int) -> jax.Array:
    """Rows ``offset..offset+tokens-1`` of a learned position embedding's table (positions, width)."""
    return lax.dynamic_slice_in_dim(table, offset, tokens)


def attend(x: jax.Array, w: list, layer: Attention, cache: tuple[jax.Array, jax.Array], offset: Any,
           prefill: bool) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``jax_transformer.attention`` for tokens (N, T, d) at positions ``offset..``: writes their keys
    and values into ``cache`` there, then attends (the prefill to its own keys, causally; a decode
    step to the cache up to its position). Returns (output, updated cache)."""
    heads, groups, dh = layer.heads, layer.groups, layer.head_dim
    pairs = [(w[i], w[i + 1]) for i in range(0, 8, 2)] if layer.use_bias else [(w[i], None) for i in range(4)]
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = pairs
    n, t = x.shape[:2]
    ck, cv = cache
    positions = ck.shape[2]
    q = jax_transformer.split_heads(jax_transformer._project(x, wq, bq), heads)
    k = jax_transformer.split_heads(jax_transformer._project(x, wk, bk), groups)
    v = jax_transformer.split_heads(jax_transformer._project(x, wv, bv), groups)
    if layer.rope is not None:
        q, k = (rope_at(a, offset, positions, layer.rope.base, layer.rope.pairing) for a in (q, k))
    k, v = (a.transpose(0, 2, 1, 3).astype(ck.dtype) for a in (k, v))  # (N, kv_heads, T, head_dim)
    ck, cv = write(ck, k, offset), write(cv, v, offset)
    if prefill:  # its own keys, as they are held in the cache (its dtype)
        keys, vals, mask = k, v, jax_transformer.causal_mask(t)
    else:
        keys, vals, mask = ck, cv, visible(offset, t, positions)
    keys, vals = keys.astype(x.dtype), vals.astype(x.dtype)
    qg = q.reshape(n, t, groups, heads // groups, dh)  # query head h = g * share + s reads kv head g
    scores = jnp.einsum("ntgsd,ngkd->ngstk", qg, keys,
                        preferred_element_type=jnp.float32) * jax_transformer.score_scale(dh)
    if layer.causal:
        scores = jnp.where(mask, scores, -jnp.inf)
    p = jax_transformer.softmax(scores).astype(x.dtype)
    mixed = jnp.einsum("ngstk,ngkd->ntgsd", p, vals).reshape(n, t, heads * dh)
    return jax_transformer._project(mixed, wo, bo), (ck, cv)


def check(workload: Workload, g: Graph, positions: int) -> None:
    """``BackendUnavailable`` unless this graph can be decoded token by token with a cache."""
    if not workload.next_token:
        raise BackendUnavailable("jax: generation needs a language model (next-token outputs)")
    for node in g.nodes:
        layer = node.layer
        if isinstance(layer, Attention) and not layer.causal:
            raise BackendUnavailable(f"jax: {node.label()} is not causal: a cache cannot generate with it")
        if isinstance(layer, (Tokens, ClassToken, SelectToken, GlobalAvgPool, Flatten)):
            raise BackendUnavailable(f"jax: {node.label()} mixes tokens: not a decoder")
        if isinstance(layer, PositionEmbedding) and positions > node.weights[0][0]:
            raise BackendUnavailable(f"jax: {positions} positions exceed the position embedding's "
                                     f"{node.weights[0][0]} rows")


class Generator:
    """One cache of ``batch`` x ``positions`` tokens and the compiled functions that fill it."""

    def __init__(self, workload: Workload, params: list, compute: Any, device: Any, batch: int, positions: int,
                 scan: bool):
        g = resolve(workload)
        check(workload, g, positions)
        last = g.output.index
        fns = ["none" if n.index == last else activation_name(n.layer, n.activation) for n in g.nodes]
        attns = [n.index for n in g.nodes if isinstance(n.layer, Attention)]
        tail = max(attns, default=-1)  # nodes after it read only the last position
        self.traces: Counter = Counter()  # how many times each function was traced (a test reads it)
        self.positions, self.device = positions, device
        dtype = CACHE_DTYPES[workload.generating.cache]
        self.params = [p.astype(compute) for p in params]

        def forward(params: list, cache: Cache, ids: jax.Array, offset: Any, prefill: bool
                    ) -> tuple[jax.Array, Cache]:
            """Next token ids (N,) int32 after ``ids`` (N, T) at positions ``offset..``, and the cache."""
            values: dict[int, Any] = {INPUT: ids}
            cache = list(cache)
            for node in g.nodes:
                ins = [values[j] for j in node.inputs]
                if node.index > tail:
                    ins = [a[:, -1:] for a in ins]
                w = g.weights_of(node, params)
                if node.tied is not None:
                    w = [jax_graph.tied_kernel(g.weights_of(g.nodes[node.tied], params)[0])] + w
                if isinstance(node.layer, Attention):
                    i = attns.index(node.index)
                    out, cache[i] = attend(ins[0], w, node.layer, cache[i], offset, prefill)
                elif isinstance(node.layer, PositionEmbedding):
                    out = ins[0] + position_rows(w[0], offset, ins[0].shape[1]).astype(ins[0].dtype)
                else:
                    out = jax_graph._apply(node, ins, w, None, False, [])
                values[node.index] = jax_graph.activate(out, fns[node.index])
            z = values[last][:, -1].astype(jnp.float32)
            return jnp.argmax(z, axis=-1).astype(jnp.int32), cache

        @partial(jax.jit, donate_argnums=(1,))
        def prefill(params, cache, ids):
            self.traces["prefill"] += 1
            return forward(params, cache, ids, 0, True)

        @partial(jax.jit, donate_argnums=(1,))
        def decode(params, cache, ids, position):
            self.traces["decode"] += 1
            return forward(params, cache, ids[:, None], position, False)

        @partial(jax.jit, static_argnames=("steps",), donate_argnums=(1,))
        def decode_steps(params, cache, ids, position, steps):
            self.traces["decode_steps"] += 1

            def body(carry, k):
                cache, token = carry
                token, cache = forward(params, cache, token[:, None], position + k, False)
                return (cache, token), token

            (cache, _), tokens = lax.scan(body, (cache, ids), jnp.arange(steps, dtype=jnp.int32))
            return tokens.T, cache  # (N, steps)

        self._prefill, self._decode, self._decode_steps = prefill, decode, decode_steps
        self.cache: Cache = [
            tuple(jax.device_put(jnp.zeros((batch, g.nodes[i].layer.groups, positions, g.nodes[i].layer.head_dim),
                                           dtype), device) for _ in (0, 1)) for i in attns]
        # Compile now (untimed) by running once: the decode step, whose shapes do not depend on the
        # prompt, and the prefill and the scan of the spec's prompt length P = positions - G when
        # that is what the worker asks (another P compiles at its first pass). Each pass writes the
        # cache from position 0, so what these write is overwritten.
        zeros = jax.device_put(jnp.zeros((batch,), jnp.int32), device)
        _, self.cache = decode(self.params, self.cache, zeros, np.int32(0))
        new = workload.generating.new_tokens
        if positions > new:
            self.prefill(np.zeros((batch, positions - new), np.int32))
            if scan:
                self.decode_steps(zeros, positions - new, new - 1)
        jax.block_until_ready(self.cache)

    def prefill(self, ids: np.ndarray) -> jax.Array:
        token, self.cache = self._prefill(self.params, self.cache, jax.device_put(np.asarray(ids, np.int32),
                                                                                  self.device))
        return token

    def decode(self, ids: jax.Array, position: int) -> jax.Array:
        token, self.cache = self._decode(self.params, self.cache, ids, np.int32(position))
        return token

    def decode_steps(self, ids: jax.Array, position: int, steps: int) -> jax.Array:
        tokens, self.cache = self._decode_steps(self.params, self.cache, ids, np.int32(position), steps=steps)
        return tokens

    def cache_bytes(self) -> tuple[int, int]:
        return sum(int(a.nbytes) for pair in self.cache for a in pair), self.positions



class Generates:
    """The adapter's generation methods (``Backend``'s contract), on a :class:`Generator` of its
    parameters as they are; mixed into ``JaxBackend``."""

    generation_note = ""

    def start_generation(self, batch: int, positions: int) -> None:
        self._generator = Generator(self.workload, self.params, self.compute, self.device, batch, positions,
                                    scan=self.mode == "scan")

    def prefill(self, ids: np.ndarray) -> jax.Array:
        self._pending = self._generator.prefill(ids)
        return self._pending

    def decode(self, ids: jax.Array, position: int) -> jax.Array:
        self._pending = self._generator.decode(ids, position)
        return self._pending

    def decode_steps(self, ids: jax.Array, position: int, steps: int) -> Optional[jax.Array]:
        if self.mode != "scan":
            return None
        self._pending = self._generator.decode_steps(ids, position, steps)
        return self._pending

    def cache_bytes(self) -> tuple[int, int]:
        return self._generator.cache_bytes()
