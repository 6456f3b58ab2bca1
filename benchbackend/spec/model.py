"""What every backend shares about a workload's network: parameter and FLOP counts, the canonical
weights and their initial values, and the layout conversions (the graph itself: ``graph.py``).

Canonical layout (what every adapter converts from):

- activations NHWC;
- one flat list of weight arrays, layer by layer in spec order, each layer's in Keras' own order:
  conv2d ``kernel`` HWIO ``(kh, kw, c_in, c_out)`` then ``bias (c_out,)`` when ``use_bias``;
  dense ``kernel (in, out)`` then ``bias (out,)``; batchnorm ``gamma, beta, moving_mean,
  moving_variance``, each ``(channels,)``; other layers have none;
- a dense kernel's input rows follow NHWC flatten order ``(h, w, c)``;
- token sequences ``(N, T, d)``, batch first, tokens in ``tokens``' row-major (h, w) order, the
  class token (when there is one) first; a dense layer on tokens has the dense layout above, applied
  to the last axis; layernorm ``gamma, beta``, each ``(d,)``; class token ``(d,)``; position
  embedding ``(T, d)``, T counting the class token when it comes after one;
- attention, eight arrays in this order: ``q_kernel (d, heads * head_dim)``, ``q_bias (heads * head_dim,)``,
  ``k_kernel``, ``k_bias``, ``v_kernel``, ``v_bias`` (the same shapes), ``o_kernel (heads * head_dim, d)``,
  ``o_bias (d,)``. Keras-dense order (``y = x @ kernel + bias``); column ``i * head_dim + j`` of a
  q/k/v kernel is dimension j of head i (heads major), so Keras' ``MultiHeadAttention`` per-head
  kernels are ``q_kernel.reshape(d, heads, head_dim)`` and its output kernel
  ``o_kernel.reshape(heads, head_dim, d)``; torch's packed ``in_proj_weight`` is
  ``concatenate([q_kernel.T, k_kernel.T, v_kernel.T])`` (``(3 * heads * head_dim, d)``, torch
  needing ``heads * head_dim == d``) and ``out_proj.weight`` is ``o_kernel.T``. Per head, the
  output is ``softmax(q k^T / sqrt(head_dim)) v``; the heads are concatenated in head order
  before the output projection.

For a straight stack of conv2d and dense layers that is ``[kernel0, bias0, kernel1, bias1, ...]``,
Keras' ``get_weights`` order. The parameter count counts every array, batchnorm's moving
statistics included (non-trainable), as Keras' ``count_params()`` does.

Initial weights are Keras' defaults: Glorot-uniform kernels, zero biases, gamma 1, beta 0,
moving mean 0, moving variance 1. They are drawn from ``default_rng([seed, repeat, 0x5EED])``,
one ``uniform`` per kernel in order, so they are deterministic in (seed, repeat) and a network of
conv2d and dense layers only gets the weights it always got. The transformer layers (the PyTorch
ViT's choices where Keras has no default): attention's four kernels Glorot-uniform over their 2-D
shapes and zero biases; layernorm gamma 1, beta 0; the class token 0; the position embedding
``normal(0, 0.02)`` (``transformer.POSITION_STDDEV``), one ``standard_normal`` draw from the same
generator, in weight order. Weight decay reaches the conv, dense and attention kernels only (not
biases, norms, the class token or the position embedding).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from . import graph as graph_mod
from .graph import Graph, Node, resolve, same_pads
from .layers import TOKEN_LAYERS, Attention, BatchNorm, Conv2D, Dense, activation_of
from .transformer import POSITION_STDDEV, initial_kind
from .workload import Workload

__all__ = ["conv_out", "describe", "final_softmax", "flops_per_sample", "from_nchw_weights",
           "initial_weights", "kernel_mask", "nhwc_to_nchw_rows", "param_count", "same_pads", "to_nchw_weights",
           "trainable_count", "vocabulary", "weight_shapes"]


def conv_out(size: int, kernel: int, stride: int, padding: Any) -> int:
    """Output length of a conv2d (or max-pool) of ``kernel`` at ``stride`` with ``padding`` (any form)."""
    pads = graph_mod.resolve_pads(padding, size, size, kernel, stride)[0]
    return graph_mod.window_out(size, pads, kernel, stride)


def describe(workload: Workload) -> list[Node]:
    """The resolved graph's nodes; raises ``ValueError`` (one line naming the layer) when the spec
    is not a valid graph or a layer does not fit its input."""
    return list(resolve(workload).nodes)


def param_count(workload: Workload) -> int:
    """Every weight array's size, batchnorm's moving statistics included (Keras' ``count_params``)."""
    return sum(n.params for n in describe(workload))


def vocabulary(workload: Workload) -> set[str]:
    """What the network asks of an adapter, in the words of the registry's ``BackendSpec.builds``:
    its layer types, ``gelu`` or ``silu`` when an activation is one, ``tokens`` when a layer reads
    a token sequence (T, d), and the decoder's conventions, each a word of its own so that an
    adapter that builds ``attention`` but not its causal mask cannot run a causal network as an
    open one: ``causal``, ``rope``, ``kv_heads`` (grouped-query), ``no_bias`` (projections or a
    dense layer without biases), ``tied`` (a dense layer tied to an embedding) and
    ``next_token`` (the language model's task: labels and scores per position)."""
    nodes = describe(workload)
    words = {n.kind for n in nodes} | {n.activation for n in nodes if n.activation in ("gelu", "silu")}
    words |= {"tokens" for n in nodes if any(len(s) == 2 for s in n.in_shapes)}
    for n in nodes:
        layer = n.layer
        if isinstance(layer, Attention):
            words |= {w for w, on in (("causal", layer.causal), ("rope", layer.rope is not None),
                                      ("kv_heads", layer.groups != layer.heads), ("no_bias", not layer.use_bias)) if on}
        if isinstance(layer, Dense):
            words |= {w for w, on in (("tied", layer.tied_to is not None), ("no_bias", not layer.use_bias)) if on}
    return words | ({"next_token"} if workload.next_token else set())


def trainable_count(workload: Workload) -> int:
    return sum(math.prod(s) for n in describe(workload) for s, t in zip(n.weights, n.trainable) if t)


def flops_per_sample(workload: Workload) -> int:
    """Forward FLOPs of one sample (a multiply-add counts 2); a training sample, x
    ``results.TRAIN_FLOPS_FACTOR``."""
    return sum(n.flops for n in describe(workload))


def weight_shapes(workload: Workload) -> list[tuple[int, ...]]:
    """Canonical shapes of the flat weight list."""
    return resolve(workload).weight_shapes()


def kernel_mask(g: Graph) -> list[bool]:
    """Per weight array: is it a conv or dense kernel (what weight decay applies to)?"""
    return [k for n in g.nodes for k in n.kernel]


def trainable_mask(g: Graph) -> list[bool]:
    """Per weight array: is it trained (batchnorm's moving statistics are not)?"""
    return [t for n in g.nodes for t in n.trainable]


def initial_weights(workload: Workload, repeat: int = 0) -> list[np.ndarray]:
    """Keras-default initial weights, float32, canonical layout; deterministic in (workload.seed,
    repeat): every backend of a repeat starts from these."""
    rng = np.random.default_rng([workload.seed, repeat, 0x5EED])
    weights: list[np.ndarray] = []
    for node in describe(workload):
        for j, shape in enumerate(node.weights):
            if node.kernel[j]:
                receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
                fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
                limit = math.sqrt(6.0 / (fan_in + fan_out))
                weights.append(rng.uniform(-limit, limit, size=shape).astype(np.float32))
            elif isinstance(node.layer, BatchNorm) and j in (0, 3):  # gamma, moving variance
                weights.append(np.ones(shape, np.float32))
            elif isinstance(node.layer, TOKEN_LAYERS) and initial_kind(node.layer, j) == "ones":
                weights.append(np.ones(shape, np.float32))
            elif isinstance(node.layer, TOKEN_LAYERS) and initial_kind(node.layer, j) == "normal":
                weights.append((rng.standard_normal(shape) * POSITION_STDDEV).astype(np.float32))
            else:
                weights.append(np.zeros(shape, np.float32))
    return weights


def nhwc_to_nchw_rows(h: int, w: int, c: int) -> np.ndarray:
    """Index array ``p`` with ``kernel_nchw = kernel_nhwc[p]`` for a dense layer after flatten.

    Row ``i`` of an NCHW-flattened input is element (c, h, w); it sits at row ``(h*W + w)*C + c``
    of the NHWC-flattened kernel.
    """
    cc, hh, ww = np.meshgrid(np.arange(c), np.arange(h), np.arange(w), indexing="ij")
    return ((hh * w + ww) * c + cc).reshape(-1)


def _rows(g: Graph, node: Node) -> Any:
    """The NCHW row permutation for ``node``'s flat input, or None when its input is not a flattened image."""
    j = node.inputs[0]
    flat = None if j == graph_mod.INPUT else g.nodes[j].flat_from
    return None if flat is None else nhwc_to_nchw_rows(*flat)


def to_nchw_weights(workload: Workload, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The canonical weights for an NCHW framework (torch, Chainer), same list order: conv kernels
    OIHW, dense kernels (out, in); a dense kernel (and batchnorm vectors) reading a flattened image
    with its rows in NCHW flatten order. Inverse: :func:`from_nchw_weights`."""
    return _convert(workload, weights, to_nchw=True)


def from_nchw_weights(workload: Workload, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The canonical layout back from :func:`to_nchw_weights`' layout."""
    return _convert(workload, weights, to_nchw=False)


def _convert(workload: Workload, weights: Sequence[np.ndarray], to_nchw: bool) -> list[np.ndarray]:
    g = resolve(workload)
    out: list[np.ndarray] = []
    for node in g.nodes:
        arrays = g.weights_of(node, weights)
        rows = _rows(g, node)
        for j, a in enumerate(arrays):
            a = np.asarray(a)
            if isinstance(node.layer, Conv2D) and j == 0:
                a = np.transpose(a, (3, 2, 0, 1) if to_nchw else (2, 3, 1, 0))  # HWIO <-> OIHW
            elif isinstance(node.layer, Dense) and j == 0 and node.tied is None:
                if to_nchw:
                    a = (a if rows is None else a[rows]).T
                else:
                    a = a.T if rows is None else a.T[np.argsort(rows)]
            elif isinstance(node.layer, BatchNorm) and rows is not None:
                a = a[rows] if to_nchw else a[np.argsort(rows)]
            out.append(np.ascontiguousarray(a))
    return out


def final_softmax(layers: Sequence[Any]) -> bool:
    """True when the network ends in a softmax (so it outputs probabilities, not logits)."""
    return activation_of(layers[-1]) == "softmax"
