"""The decoder layers of the resolved graph (``embedding``, ``rmsnorm``, attention with ``causal``,
``kv_heads``, ``rope`` and ``use_bias``, a dense layer ``tied_to`` an embedding) as Chainer links, on
the canonical weights of ``benchbackend.spec.model``; token sequences are (N, T, d), batch first.

The conventions are the reference's (``backends/numpy/transformer.py``); where Chainer differs, this
module converts:

- ``embedding`` (:class:`Embedding`): the ids arrive as float32 whole numbers; ``F.embed_id`` wants
  integers, and a cast outside a Chainer function would run once under ``static_graph`` (the replayed
  schedule would read the first batch's ids for ever). So the lookup is a function node of its own
  (:class:`_Lookup`) that casts inside its ``forward``; its gradient (:class:`_LookupGrad`, a node
  too, so ``static_graph`` records it) sums each id's positions into the table's row;
- ``rmsnorm`` (:class:`RMSNorm`): ``x / sqrt(mean(x^2) + epsilon) * s``, ``s = w`` or ``1 + w``
  (:func:`rms_scale`), the spec's epsilon;
- attention (:class:`Attention`, the one self-attention: a ViT's plain one is the case without the
  decoder's fields): its four ``L.Linear`` hold ``(out, in)``, the canonical kernels' transpose
  (``TRANSPOSED`` flags them for loading and reading back); heads-major columns; rotary positions (:func:`rope_tables`,
  :func:`rope_rotate`) on q and k after their projection, at positions 0..T-1; key/value head
  ``h // (heads // kv_heads)`` for query head h (:func:`repeat_kv`: ``F.repeat``, blocks); the
  causal mask (:func:`causal_mask`, key j <= query i) added as 0 / -inf before the softmax over the
  keys (a masked key gets weight 0 and no gradient). The rotation and the mask are function nodes
  holding their tables (:class:`_Rotate`, :class:`_AddMask`): a replayed ``static_graph`` schedule
  loses an array added to a variable as a plain ``+`` operand;
- a tied dense (:class:`TiedDense`): ``F.linear`` on the embedding link's own ``W`` (``(vocab,
  width)`` is ``F.linear``'s ``(out, in)``): one parameter, both uses' gradients summed in it. Its
  weights are its bias alone, if any.

The module-level functions are looked up when a layer runs (or, for the tables, when it is built),
so a test can plant a wrong convention by replacing one of them (``tests/support/chainer_decoder_planted.py``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
from chainer import backend, function_node

from ...spec import layers
from ...spec.graph import Node
from .transformer import TokenLink

Op = Callable[[list, Any], Any]


# --- conventions (module-level: tests replace them) -------------------------------------------------
def rope_tables(tokens: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (T, head_dim/2) float32: position p, pair i turns by ``p * base ** (-2i / head_dim)``
    (the angles in float64, as the reference takes them)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.outer(np.arange(tokens, dtype=np.float64), inv_freq)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope_rotate(a: Any, cos: np.ndarray, sin: np.ndarray, pairing: str) -> Any:
    """Queries or keys (N, heads, T, head_dim) turned by their positions: pairs (i, i + head_dim/2)
    for ``half``, (2i, 2i + 1) for ``interleaved`` (:class:`_Rotate`)."""
    return _Rotate(cos, sin, pairing).apply((a,))[0]


def causal_mask(tokens: int) -> np.ndarray:
    """(T, T) bool: query i may read key j (j <= i)."""
    return np.tril(np.ones((tokens, tokens), dtype=bool))


def repeat_kv(a: Any, share: int) -> Any:
    """Key/value heads (N, kv_heads, T, head_dim) as (N, heads, T, head_dim): each repeated for the
    ``share`` consecutive query heads of its block (query head h reads h // share)."""
    return a if share == 1 else F.repeat(a, share, axis=1)


def rms_scale(w: Any, one_plus: bool) -> Any:
    """RMSNorm's scale from its weight: ``1 + w`` (``one_plus_w``) or ``w``."""
    return 1.0 + w if one_plus else w


# --- constants as function nodes ------------------------------------------------------------------
# ``variable + ndarray`` makes an ``Add`` whose second input is the array: a replayed static schedule
# does not keep such an array (it reads None). The rotation and the mask hold their tables instead.
class _Rotate(function_node.FunctionNode):
    """RoPE on (N, heads, T, head_dim) arrays by the (T, head_dim/2) tables; its gradient is the inverse
    rotation (the transpose), a node of its own (``static_graph`` records it)."""

    def __init__(self, cos: np.ndarray, sin: np.ndarray, pairing: str, inverse: bool = False):
        super().__init__()
        self.cos, self.sin, self.pairing, self.inverse = cos, sin, pairing, inverse

    def forward(self, inputs: tuple) -> tuple:
        a, = inputs
        xp = backend.get_array_module(a)
        t = a.shape[2]
        cos, sin = xp.asarray(self.cos[:t], a.dtype), xp.asarray(self.sin[:t], a.dtype)
        if self.inverse:
            sin = -sin
        if self.pairing == "half":
            half = a.shape[3] // 2
            x1, x2 = a[..., :half], a[..., half:]
            return xp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1),
        x1, x2 = a[..., 0::2], a[..., 1::2]
        out = xp.empty_like(a)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out,

    def backward(self, indexes: Any, grad_outputs: tuple) -> tuple:
        return _Rotate(self.cos, self.sin, self.pairing, not self.inverse).apply(grad_outputs)


class _AddMask(function_node.FunctionNode):
    """Scores (N*heads, T, T) plus the (T, T) mask of 0 and -inf; the gradient passes as it is (a
    masked score's softmax weight is 0, so its gradient is too)."""

    def __init__(self, mask: np.ndarray):
        super().__init__()
        self.mask = mask

    def forward(self, inputs: tuple) -> tuple:
        scores, = inputs
        t = scores.shape[-1]
        return scores + backend.get_array_module(scores).asarray(self.mask[:t, :t]),

    def backward(self, indexes: Any, grad_outputs: tuple) -> tuple:
        return grad_outputs


# --- embedding ---------------------------------------------------------------------------------------
class _Lookup(function_node.FunctionNode):
    """(float ids (N, T), table (vocab, width)) -> rows (N, T, width); the ids cast to int32 here."""

    def forward(self, inputs: tuple) -> tuple:
        self.retain_inputs((0,))
        ids, table = inputs
        self.vocab = table.shape[0]
        return table[ids.astype(np.int32)],

    def backward(self, indexes: Any, grad_outputs: tuple) -> tuple:
        ids, = self.get_retained_inputs()
        return None, _LookupGrad(self.vocab).apply((ids, grad_outputs[0]))[0]


class _LookupGrad(function_node.FunctionNode):
    """The table's gradient: each id's row gets the sum of its positions' gradients."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, inputs: tuple) -> tuple:
        ids, gy = inputs
        xp = backend.get_array_module(gy)
        width = gy.shape[-1]
        index = ids.astype(np.int32).reshape(-1)
        d_table = xp.zeros((self.vocab, width), gy.dtype)
        if xp is np:
            np.add.at(d_table, index, gy.reshape(-1, width))
        else:
            import cupyx

            cupyx.scatter_add(d_table, index, gy.reshape(-1, width))
        return d_table,


class Embedding(TokenLink):
    """Token ids (N, T), float32 whole numbers, -> (N, T, width): rows of ``W`` (vocab, width), the
    canonical table as it is."""

    TRANSPOSED = (False,)

    def __init__(self, vocab: int, width: int):
        super().__init__()
        with self.init_scope():
            self.W = chainer.Parameter(np.zeros((vocab, width), np.float32))

    def forward(self, ids: Any) -> Any:
        return _Lookup().apply((ids, self.W))[0]

    def arrays(self) -> list[Any]:
        return [self.W.array]


class TiedDense(TokenLink):
    """``x @ table^T (+ bias)`` on the last axis: the kernel is the embedding link's ``W``, read at
    each call, never copied; this link holds the bias alone, if any."""

    def __init__(self, embedding: Embedding, units: int, use_bias: bool):
        super().__init__()
        with self.init_scope():
            self.b = chainer.Parameter(np.zeros(units, np.float32)) if use_bias else None
        self.table = lambda: embedding.W  # a function: not a child link (the table stays the embedding's)
        self.TRANSPOSED = (False,) if use_bias else ()

    def forward(self, x: Any) -> Any:
        return F.linear(x, self.table(), self.b, n_batch_axes=x.ndim - 1)

    def arrays(self) -> list[Any]:
        return [] if self.b is None else [self.b.array]


# --- rmsnorm -----------------------------------------------------------------------------------------
class RMSNorm(TokenLink):
    """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, ``s = w`` or ``1 + w``."""

    TRANSPOSED = (False,)

    def __init__(self, width: int, epsilon: float, one_plus: bool):
        super().__init__()
        with self.init_scope():
            self.w = chainer.Parameter((np.zeros if one_plus else np.ones)(width, np.float32))
        self.epsilon, self.one_plus = epsilon, one_plus

    def forward(self, x: Any) -> Any:
        inv = F.rsqrt(F.mean(x * x, axis=-1, keepdims=True) + self.epsilon)
        return x * inv * rms_scale(self.w, self.one_plus)

    def arrays(self) -> list[Any]:
        return [self.w.array]


# --- attention ---------------------------------------------------------------------------------------
class Attention(TokenLink):
    """Self-attention of (N, T, d), a ViT's or, with the decoder's fields, a decoder's, on the canonical
    arrays: q, k, v, o kernels (``kv_heads * head_dim`` wide for k and v), each followed by its bias
    unless ``use_bias`` is off. Per query head ``softmax(q k^T / sqrt(head_dim) + mask) v``, the heads merged in head
    order, then the output projection."""

    def __init__(self, d: int, tokens: int, layer: layers.Attention):
        super().__init__()
        self.heads, self.groups, self.head_dim = layer.heads, layer.groups, layer.head_dim
        inner, kv = self.heads * self.head_dim, self.groups * self.head_dim
        nobias = not layer.use_bias
        with self.init_scope():
            self.q = L.Linear(d, inner, nobias=nobias)
            self.k, self.v = L.Linear(d, kv, nobias=nobias), L.Linear(d, kv, nobias=nobias)
            self.o = L.Linear(inner, d, nobias=nobias)
        self.use_bias = layer.use_bias
        self.TRANSPOSED = (True, False) * 4 if self.use_bias else (True,) * 4
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.pairing: Optional[str] = None
        if layer.rope is not None:  # tables of the positions 0..T-1, never trained
            self.pairing = layer.rope.pairing
            self.cos, self.sin = rope_tables(tokens, self.head_dim, layer.rope.base)
        self.mask: Optional[np.ndarray] = None
        if layer.causal:  # 0 where query i may read key j, -inf where it may not
            self.mask = np.where(causal_mask(tokens), 0.0, -np.inf).astype(np.float32)

    def _split(self, a: Any, n: int, t: int, heads: int) -> Any:
        """(N*T, heads*head_dim) -> (N, heads, T, head_dim): column i*head_dim + j is head i's j."""
        return F.transpose(F.reshape(a, (n, t, heads, self.head_dim)), (0, 2, 1, 3))

    def forward(self, x: Any) -> Any:
        n, t, d = x.shape
        flat = F.reshape(x, (n * t, d))
        q = self._split(self.q(flat), n, t, self.heads)
        k = self._split(self.k(flat), n, t, self.groups)
        v = self._split(self.v(flat), n, t, self.groups)
        if self.pairing is not None:
            q, k = rope_rotate(q, self.cos, self.sin, self.pairing), rope_rotate(k, self.cos, self.sin, self.pairing)
        share = self.heads // self.groups
        k, v = repeat_kv(k, share), repeat_kv(v, share)
        shape = (n * self.heads, t, self.head_dim)
        q, k, v = F.reshape(q, shape), F.reshape(k, shape), F.reshape(v, shape)
        scores = F.matmul(q, k, transb=True) * self.scale  # (N*heads, T queries, T keys)
        if self.mask is not None:
            scores = _AddMask(self.mask).apply((scores,))[0]
        p = F.softmax(scores, axis=2)
        mixed = F.transpose(F.reshape(F.matmul(p, v), (n, self.heads, t, self.head_dim)), (0, 2, 1, 3))
        return F.reshape(self.o(F.reshape(mixed, (n * t, self.heads * self.head_dim))), (n, t, d))

    def arrays(self) -> list[Any]:
        out = []
        for proj in (self.q, self.k, self.v, self.o):
            out += [proj.W.array, proj.b.array] if self.use_bias else [proj.W.array]
        return out

    def kernels(self) -> list[Any]:
        return [proj.W for proj in (self.q, self.k, self.v, self.o)]


def decoder_op(node: Node, holders: list[Any]) -> tuple[Any, Op]:
    """(the link holding ``node``'s weights, its op) for an embedding, an rmsnorm, an attention (a
    ViT's or a decoder's) or a tied dense layer (``holders``: the links of the earlier nodes, the tied
    embedding's among them)."""
    layer = node.layer
    link: TokenLink
    if isinstance(layer, layers.Embedding):
        link = Embedding(layer.vocab, layer.width)
    elif isinstance(layer, layers.RMSNorm):
        link = RMSNorm(node.in_shape[-1], layer.epsilon, layer.scale == "one_plus_w")
    elif isinstance(layer, layers.Attention):
        t, d = node.in_shape
        link = Attention(d, t, layer)
    elif isinstance(layer, layers.Dense) and node.tied is not None:
        link = TiedDense(holders[node.tied], layer.units, layer.use_bias)
    else:
        raise TypeError(f"{node.label()}: not a decoder layer")
    return link, lambda ins, masks: link(ins[0])
