"""The resolved graph (``benchbackend.spec.graph``) in ``jax.lax``/``jax.numpy``, on the canonical weights as they are.

``lax.conv_general_dilated`` takes NHWC x HWIO natively and flattening NHWC needs no row
permutation, so the canonical layout is JAX's own; paddings are the graph's explicit pairs (TF
'same' included), and ``reduce_window`` pads a max-pool with its ``-inf`` init value, so a pad
never wins a max. Batchnorm follows the reference: batch statistics (biased variance, computed in
float32) in a training pass, which returns them so the caller can update the moving statistics
with Keras' momentum; the moving statistics in inference. The transformer layers are
``jax_transformer``'s; dense, dropout, add and multiply take token sequences (N, T, d) as they are,
and global_avgpool averages over the tokens. A dense layer tied to an embedding reads that
embedding's table, transposed (``tied_kernel``), out of the one parameter list: one array, whose
gradient is the sum of both uses (autodiff adds them).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from ...spec.graph import INPUT, Graph, Node, resolve
from ...spec.layers import (
    GELU_TANH,
    TOKEN_LAYERS,
    ActivationLayer,
    Add,
    BatchNorm,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool2D,
    Multiply,
    activation_name,
)
from ...spec.workload import Workload
from . import transformer as jax_transformer

Params = list[jax.Array]
#: ``logits(params, x, key, train)`` -> (scores before a final softmax, [(batch mean, batch variance)
#: of each batchnorm, in order; empty unless ``train``]). ``key=None`` turns dropout off.
Forward = Callable[[Params, jax.Array, Optional[jax.Array], bool], tuple[jax.Array, list]]


def activate(x: jax.Array, fn: str) -> jax.Array:
    if fn == "relu":
        return jax.nn.relu(x)
    if fn == "tanh":
        return jnp.tanh(x)
    if fn == "sigmoid":
        return jax.nn.sigmoid(x)
    if fn == "softmax":
        return jax.nn.softmax(x, axis=-1)
    if fn == "silu":
        return jax.nn.silu(x)
    if fn in ("gelu", GELU_TANH):
        return jax_transformer.gelu(x, approximate=fn == GELU_TANH)
    return x


def _batchnorm(layer: BatchNorm, x: jax.Array, w: list, train: bool, stats: list) -> jax.Array:
    gamma, beta, mean, var = (a.astype(jnp.float32) for a in w)
    x32 = x.astype(jnp.float32)  # Keras computes batchnorm in float32 under mixed precision
    if train:
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x32, axis=axes)
        var = jnp.mean(jnp.square(x32 - mean), axis=axes)  # biased, as Keras
        stats.append((mean, var))
    out = (x32 - mean) * lax.rsqrt(var + layer.epsilon) * gamma + beta
    return out.astype(x.dtype)


def _apply(node: Node, ins: list, w: list, key: Optional[jax.Array], train: bool, stats: list) -> jax.Array:
    layer, x = node.layer, ins[0]
    if isinstance(layer, Conv2D):
        y = lax.conv_general_dilated(x, w[0], (layer.stride, layer.stride), list(node.pads),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + w[1] if layer.use_bias else y
    if isinstance(layer, Dense):  # on a flat input or the last axis of tokens
        return x @ w[0] + w[1] if layer.use_bias else x @ w[0]
    if isinstance(layer, MaxPool2D):
        s, k = layer.stride or layer.pool_size, layer.pool_size
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, k, k, 1), (1, s, s, 1), ((0, 0), *node.pads, (0, 0)))
    if isinstance(layer, BatchNorm):
        return _batchnorm(layer, x, w, train, stats)
    if isinstance(layer, Add):
        out = ins[0]
        for other in ins[1:]:
            out = out + other
        return out
    if isinstance(layer, Multiply):
        out = ins[0]
        for other in ins[1:]:
            out = out * other
        return out
    if isinstance(layer, GlobalAvgPool):  # over the pixels (N, H, W, C) or the tokens (N, T, d)
        return jnp.mean(x, axis=(1, 2) if x.ndim == 4 else 1)
    if isinstance(layer, Dropout):
        if key is not None and layer.rate > 0:  # inverted dropout, as Keras
            keep = jax.random.bernoulli(jax.random.fold_in(key, node.index), 1.0 - layer.rate, x.shape)
            return jnp.where(keep, x / (1.0 - layer.rate), jnp.zeros_like(x))
        return x
    if isinstance(layer, Flatten):
        return x.reshape(x.shape[0], -1)  # NHWC order: the canonical dense rows
    if isinstance(layer, ActivationLayer):
        return x
    if isinstance(layer, TOKEN_LAYERS):
        return jax_transformer.apply(layer, x, w)
    raise TypeError(f"{node.label()}: no JAX translation")


def tied_kernel(table: jax.Array) -> jax.Array:
    """A tied dense layer's kernel (width, vocab): its embedding's table (vocab, width), transposed."""
    return table.T


def make_forward(workload: Workload) -> tuple[Forward, Graph]:
    """The network's forward function, and the graph it walks."""
    g = resolve(workload)
    last = g.output.index
    fns = ["none" if n.index == last and n.activation == "softmax"
           else activation_name(n.layer, n.activation) for n in g.nodes]

    def logits(params: Params, x: jax.Array, key: Optional[jax.Array], train: bool) -> tuple[jax.Array, list]:
        values: dict[int, Any] = {INPUT: x}
        stats: list = []
        for node in g.nodes:
            ins = [values[j] for j in node.inputs]
            w = g.weights_of(node, params)
            if node.tied is not None:
                w = [tied_kernel(g.weights_of(g.nodes[node.tied], params)[0])] + w
            out = _apply(node, ins, w, key, train, stats)
            values[node.index] = activate(out, fns[node.index])
        return values[last], stats

    return logits, g
